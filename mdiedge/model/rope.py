"""RoPE tables (Su et al. 2021; Llama 3's frequency scaling; the sliding layers' own base), in
numpy: the one source of them for both paths (``mdiedge.model.layers`` hands them to the torch
model as tensors), so both rotate by the same values; a cos/sin rounded differently in the
last bit changes Gemma 3's logits by percents. Computed in float32 as torch computed them
before (the powers rounded from float64, as torch's scalar ** tensor rounds them)."""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from ..base.memory import zeroed_pages
from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies (head_dim/2,) float32, with ``llama3`` scaling if set;
    ``local``: the sliding layers' (their own base where the config has one, unscaled)."""
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) \
        / np.float32(cfg.head_dim)
    local = local and bool(cfg.rope_local_theta)
    base = float(cfg.rope_local_theta if local else cfg.rope_theta)
    powers = np.power(base, exponents.astype(np.float64)).astype(np.float32)  # as torch rounds
    inv_freq = np.float32(1.0) / powers
    s = cfg.rope_scaling
    if s is None or local:
        return inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(s.factor), inv_freq)
    smooth = (np.float32(s.original_max_position_embeddings) / wavelen
              - np.float32(s.low_freq_factor)) / np.float32(s.high_freq_factor
                                                            - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_rows(cfg: ModelConfig, start: int, stop: int, local: bool = False
              ) -> Tuple[np.ndarray, np.ndarray]:
    """cos and sin of positions [start, stop): rows (stop - start, head_dim) float32,
    C-contiguous, in the "rotate half" layout; each row the same whatever the range."""
    positions = np.arange(start, stop, dtype=np.float32)
    freqs = np.outer(positions, rope_inv_freq(cfg, local)).astype(np.float32)  # (L, hd/2)
    emb = np.concatenate((freqs, freqs), -1)  # (L, head_dim)
    return np.ascontiguousarray(np.cos(emb)), np.ascontiguousarray(np.sin(emb))


def rope_tables(cfg: ModelConfig, max_seq_len: int, local: bool = False
                ) -> Tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (max_seq_len, head_dim) float32, C-contiguous, in the "rotate half"
    layout."""
    return rope_rows(cfg, 0, max_seq_len, local)


class GrowingRope:
    """``rope_tables`` of ``max_seq_len`` rows whose rows are computed, and resident, only up
    to the furthest position asked for (``cover``), ``ROWS_AT_ONCE`` at a time: a long
    context costs its tables' memory as it is used, as the KV cache does (Gemma 3's two
    pairs of tables for 4096 tokens are 16 MiB; Llama 3's for 131072, 128 MiB). ``cos`` and
    ``sin`` hold zeros past ``filled``."""

    ROWS_AT_ONCE = 256

    def __init__(self, cfg: ModelConfig, max_seq_len: int, local: bool = False) -> None:
        self.cfg, self.local, self.filled = cfg, local, 0
        self.cos, self.sin = (_zero_rows(max_seq_len, cfg.head_dim) for _ in range(2))

    def cover(self, length: int) -> None:
        """Rows [0, length) computed (``length`` at most the tables' rows)."""
        if length <= self.filled:
            return
        step = self.ROWS_AT_ONCE
        stop = min(self.cos.shape[0], -(-length // step) * step)
        self.cos[self.filled:stop], self.sin[self.filled:stop] = rope_rows(
            self.cfg, self.filled, stop, self.local)
        self.filled = stop


def _zero_rows(rows: int, width: int) -> np.ndarray:
    """(rows, width) float32 zeros resident only where written (``zeroed_pages``)."""
    count = rows * width
    return np.frombuffer(zeroed_pages(4 * count), np.float32, count).reshape(rows, width)
