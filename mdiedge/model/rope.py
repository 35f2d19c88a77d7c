"""RoPE tables (Su et al. 2021; Llama 3's frequency scaling; the sliding layers' own base), in
numpy: the one source of them for both paths (``mdiedge.model.layers`` hands them to the torch
model as tensors), so both rotate by the same values; a cos/sin rounded differently in the
last bit changes Gemma 3's logits by percents. Computed in float32 as torch computed them
before (the powers rounded from float64, as torch's scalar ** tensor rounds them)."""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

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


def rope_tables(cfg: ModelConfig, max_seq_len: int, local: bool = False
                ) -> Tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (max_seq_len, head_dim) float32, C-contiguous, in the "rotate half"
    layout."""
    positions = np.arange(max_seq_len, dtype=np.float32)
    freqs = np.outer(positions, rope_inv_freq(cfg, local)).astype(np.float32)  # (L, hd/2)
    emb = np.concatenate((freqs, freqs), -1)  # (L, head_dim)
    return np.ascontiguousarray(np.cos(emb)), np.ascontiguousarray(np.sin(emb))
