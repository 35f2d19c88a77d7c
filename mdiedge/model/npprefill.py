"""A prefill on numpy, without torch: the arithmetic of the torch model's prefill
(``mdiedge.model.block``, ``layers``, ``moe``, ``qlayers``) for ``CpuModel``'s calls of more
rows than the compiled step takes. Each quantized matrix is de-quantized a tile of rows at
a time into one reused float32 buffer (the compiled de-quantizer, as ``QuantLinear``'s
prefill does) and multiplied by numpy's BLAS; attention runs per slot and KV head over the
chunk and the cache's earlier positions (causal, sliding window), every query of a head
group in one product. Products and attention are split among the node's threads as jobs of a
thread pool (BLAS and the de-quantizer let go of the GIL), BLAS itself on one thread.
Hidden states are (rows, dim) float32 here, row r = b * T + t."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import grouping
from ._stepconstants import MAX_ROWS, QuantMatrix, StackedMatrix, unpaired
from .blasthreads import follow_threads
from .config import ModelConfig
from .kernels import QUANT, STEP
from .qtypes import TYPES

_quant = QUANT.select()
_step = STEP.select()

KERNEL_ROWS = MAX_ROWS  # rows the compiled product takes; more are a prefill
TILE_BYTES = 4 << 20  # float32 bytes of the de-quantized tile a prefill multiplies by
QUERY_BLOCK = 128  # queries of a sample attending at once: keys past the block's last skipped
_local = threading.local()
_pools: List[Tuple[int, ThreadPoolExecutor]] = []


def in_parallel(jobs: Sequence[Callable[[], Any]], threads: int) -> None:
    """Run ``jobs`` on ``threads`` threads of this process's pool (numpy's BLAS and the
    de-quantizer let go of the GIL), each computing on one core: BLAS's own threads stay at
    one, so they never spin against the compiled kernels' (OpenMP) threads."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    if not _pools or _pools[0][0] != threads:
        if _pools:
            _pools.pop()[1].shutdown()
        _pools.append((threads, ThreadPoolExecutor(threads, "mdiedge-prefill")))
    for done in [_pools[0][1].submit(job) for job in jobs]:
        done.result()


@dataclass
class Rows:
    """The rows of a call: ``batch`` samples of ``seq_len`` tokens, sample b in KV slot
    ``slots[b]`` from position ``positions[b]``; the threads and the dot mode."""

    batch: int
    seq_len: int
    slots: List[int]
    positions: List[int]
    threads: int
    dot: int


def tile_buffer(floats: int) -> np.ndarray:
    """This thread's float32 buffer of at least ``floats`` values (prefill tiles)."""
    buffer = getattr(_local, "tile", None)
    if buffer is None or buffer.size < floats:
        buffer = _local.tile = np.empty(floats, np.float32)
    return buffer


def product(x: np.ndarray, matrix: Any, out: np.ndarray, threads: int, dot: int) -> np.ndarray:
    """out (rows, n) = x (rows, in) @ matrix.T as the torch model multiplies: a stacked
    matrix part by part into its columns; a quantized one by the compiled product up to
    ``KERNEL_ROWS`` rows (the dot mode's arithmetic) or where ``integer_prefill`` says, else
    by de-quantized tiles and BLAS; a float one by BLAS; more rows than that split among
    ``threads``."""
    if isinstance(matrix, StackedMatrix):
        column = 0
        for part in matrix.parts:
            product(x, part, out[:, column:column + part.shape[0]], threads, dot)
            column += part.shape[0]
    elif isinstance(matrix, QuantMatrix) and (x.shape[0] <= KERNEL_ROWS
                                              or integer_prefill(matrix.qtype, dot)):
        _quant.matmul(x, matrix.data, matrix.qtype, out, threads, dot, x8=matrix.x8)
    else:
        n, k = matrix.shape
        share = -(-n // max(1, threads))
        if isinstance(matrix, QuantMatrix):  # every thread's tile within TILE_BYTES together
            share = max(1, min(share, TILE_BYTES // (4 * k * max(1, threads))))
        in_parallel([_piece(x, matrix, out, first, min(n, first + share))
                     for first in range(0, n, share)], threads)
    return out


def integer_prefill(qtype: str, dot: int) -> bool:
    """Whether a prefill multiplies a ``qtype`` matrix by the compiled integer kernels (dot:
    the q8 mode) rather than by de-quantized tiles and BLAS, on both paths alike: for the
    types whose activations the q8 mode quantizes in 256-blocks (the K-quants, IQ4_XS) where
    this CPU has their kernels (1.4-2x the tiles' speed on AVX512-VNNI, about even on AVX2),
    and for those with an x8 layout there (``cpuload.x8_pays``: Q4_1's 480-row products
    1.2-1.6x the tiles'); the other 32-weight types' row kernels ran 0.8-1.0x, so they keep
    the tiles."""
    if not dot or qtype not in _quant.q8_types():
        return False
    return TYPES[qtype].act_block == 256 or qtype in _quant.x8_types()


def _piece(x: np.ndarray, matrix: Any, out: np.ndarray, first: int, end: int
           ) -> Callable[[], None]:
    """A job: out's columns [first, end) = x @ rows [first, end) of matrix, a quantized
    one's de-quantized into this thread's tile buffer (``QuantLinear._tiled``)."""
    def run() -> None:
        if not isinstance(matrix, QuantMatrix):
            np.matmul(x, matrix[first:end].T, out=out[:, first:end])
            return
        k = matrix.shape[1]
        tile = tile_buffer((end - first) * k)[:(end - first) * k].reshape(end - first, k)
        _quant.dequantize_rows(matrix.data, matrix.qtype, first, end - first, tile, 1)
        np.matmul(x, tile.T, out=out[:, first:end])
    return run


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, float32 (``layers``)."""
    scale = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    scale += np.float32(eps)
    np.sqrt(scale, out=scale)
    np.divide(np.float32(1.0), scale, out=scale)
    normed = x * scale
    normed *= weight
    return normed


def gated(both: np.ndarray, activation: str, threads: int) -> np.ndarray:
    """act(gate) * up of both = [gate | up] (rows, 2 hidden) into a new (rows, hidden) array,
    as the decode step computes it (``act_mul``: in the step's lanes, on ``threads`` threads
    of the kernels' own team, where the step is compiled)."""
    out = np.empty((both.shape[0], both.shape[1] // 2), np.float32)
    return _step.act_mul(both, out, activation, threads)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (…, T, hd) with cos, sin broadcasting to it (``apply_rope``)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def run_blocks(cfg: ModelConfig, blocks: Sequence[Any], caches: Sequence[Tuple[Any, Any]],
               tables: Sequence[Tuple[np.ndarray, np.ndarray]], x: np.ndarray,
               rows: Rows) -> np.ndarray:
    """Every block (``cpumodel.BlockParts``, with its cache and RoPE tables) on x (rows,
    dim); returns the last block's output."""
    follow_threads(1)
    for parts, cache, table in zip(blocks, caches, tables):
        x = block(cfg, parts, cache, table, x, rows)
    return x


def block(cfg: ModelConfig, parts: Any, cache: Tuple[np.ndarray, np.ndarray],
          table: Tuple[np.ndarray, np.ndarray], x: np.ndarray, rows: Rows) -> np.ndarray:
    """One pre-norm block (``block.Block.forward``), sandwich norms where it has them."""
    eps, options = cfg.rms_norm_eps, parts.options
    attended = attention(cfg, parts, cache, table, rms_norm(x, parts.attn_norm, eps), rows)
    if options.get("post_attn_norm") is not None:
        attended = rms_norm(attended, options["post_attn_norm"], eps)
    x = x + attended
    normed = rms_norm(x, parts.mlp_norm, eps)
    if parts.experts is not None:
        fed = experts(cfg, parts, normed, rows)
    else:
        fed = feed_forward(normed, parts.gate_up, parts.down, options.get("activation", "silu"),
                           rows)
    if options.get("post_mlp_norm") is not None:
        fed = rms_norm(fed, options["post_mlp_norm"], eps)
    x += fed
    return x


def feed_forward(x: np.ndarray, gate_up: Any, down: Any, activation: str,
                 rows: Rows) -> np.ndarray:
    """``down(act(gate(x)) * up(x))`` with gate and up one stacked product (``MLP``)."""
    hidden = gate_up.shape[0] // 2
    both = product(x, gate_up, np.empty((x.shape[0], 2 * hidden), np.float32), rows.threads,
                   rows.dot)
    mixed = gated(both, activation, rows.threads)
    del both
    return product(mixed, down, np.empty((x.shape[0], down.shape[0]), np.float32),
                   rows.threads, rows.dot)


def experts(cfg: ModelConfig, parts: Any, x: np.ndarray, rows: Rows) -> np.ndarray:
    """A mixture of experts (``moe.MoE.forward``): softmax routing, the top k (renormed
    where the config says), each expert once on its tokens, weighted outputs added."""
    router, gate_ups, downs = parts.experts
    logits = product(x, router, np.empty((x.shape[0], router.shape[0]), np.float32),
                     rows.threads, rows.dot)
    probs = softmax(logits)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg.experts_per_token]
    weights = np.take_along_axis(probs, chosen, -1)
    if cfg.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    offsets, token_idx, grouped = grouping.group_by_expert(chosen, weights, len(gate_ups))
    if parts.counts is not None:
        parts.counts += np.diff(offsets)
    out = np.zeros_like(x)
    for e, (gate_up, down) in enumerate(zip(gate_ups, downs)):
        start, end = int(offsets[e]), int(offsets[e + 1])
        if start == end:
            continue
        picked = token_idx[start:end]
        fed = feed_forward(np.ascontiguousarray(x[picked]), gate_up, down, "silu", rows)
        fed *= grouped[start:end, None]
        out[picked] += fed
    return out


def softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in place; returns scores."""
    scores -= scores.max(-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(-1, keepdims=True)
    return scores


def attention(cfg: ModelConfig, parts: Any, cache: Tuple[np.ndarray, np.ndarray],
              table: Tuple[np.ndarray, np.ndarray], x: np.ndarray, rows: Rows) -> np.ndarray:
    """Grouped-query attention of x (rows, dim), already normed (``block.Attention``):
    Q/K/V in one product (+ bias), Q/K head norms, RoPE, keys and values written to the
    cache, each sample's queries attending its slot's cache; then ``wo``."""
    options, hd = parts.options, cfg.head_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    qkv = product(x, parts.qkv, np.empty((x.shape[0], q_dim + 2 * kv_dim), np.float32),
                  rows.threads, rows.dot)
    if options.get("qk_pairs"):
        qkv[:, :q_dim + kv_dim] = unpaired(qkv[:, :q_dim + kv_dim], hd)
    if options.get("qkv_bias") is not None:
        qkv += options["qkv_bias"]
    shape = (rows.batch, rows.seq_len, -1, hd)
    q = qkv[:, :q_dim].reshape(shape).transpose(0, 2, 1, 3)  # (B, heads, T, hd)
    k = qkv[:, q_dim:q_dim + kv_dim].reshape(shape).transpose(0, 2, 1, 3)
    v = qkv[:, q_dim + kv_dim:].reshape(shape).transpose(0, 2, 1, 3)  # (B, kv, T, hd)
    if options.get("q_norm") is not None:
        q = rms_norm(q, options["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, options["k_norm"], cfg.rms_norm_eps)
    at = np.asarray(rows.positions)[:, None] + np.arange(rows.seq_len)  # (B, T)
    cos, sin = table[0][at][:, None], table[1][at][:, None]  # (B, 1, T, hd)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    keys, values = cache
    out = np.empty((rows.batch, rows.seq_len, cfg.n_heads, hd), np.float32)
    scale = options.get("attn_scale") or hd ** -0.5
    for b, (slot, start) in enumerate(zip(rows.slots, rows.positions)):
        keys[slot, :, start:start + rows.seq_len] = k[b]
        values[slot, :, start:start + rows.seq_len] = v[b]
        attend(q[b], keys[slot], values[slot], out[b], start, options.get("window", 0) or 0,
               scale, rows.threads)
    del qkv, q, k, v
    flat = out.reshape(rows.batch * rows.seq_len, q_dim)
    return product(flat, parts.wo, np.empty((flat.shape[0], cfg.dim), np.float32),
                   rows.threads, rows.dot)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, out: np.ndarray, start: int,
           window: int, scale: float, threads: int = 1) -> None:
    """One sample's queries q (heads, T, hd) at positions start.. over its slot's keys and
    values (kv_heads, L, hd) up to its last position, causal and within ``window`` (0: all);
    out (T, heads, hd). Each KV head's group of query heads in one product per block of
    ``QUERY_BLOCK`` queries, which reads the keys up to its last query only."""
    n_heads, seq_len, hd = q.shape
    group = n_heads // keys.shape[0]
    jobs = []
    for a in range(0, seq_len, QUERY_BLOCK):
        b = min(seq_len, a + QUERY_BLOCK)
        first = max(0, start + a - window + 1) if window else 0
        query_pos = np.arange(start + a, start + b)[:, None]
        key_pos = np.arange(first, start + b)[None, :]
        allowed = key_pos <= query_pos
        if window:
            allowed &= key_pos > query_pos - window
        bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        for h in range(keys.shape[0]):
            heads = slice(h * group, (h + 1) * group)
            jobs.append(_attend_job(q[heads, a:b], keys[h, first:start + b],
                                    values[h, first:start + b], bias, scale,
                                    out[a:b, heads]))
    in_parallel(jobs, threads)


def _attend_job(q: np.ndarray, keys: np.ndarray, values: np.ndarray, bias: np.ndarray,
                scale: float, out: np.ndarray) -> Callable[[], None]:
    """A job: queries q (group, Tb, hd) of one KV head over its keys and values (L, hd),
    ``bias`` (Tb, L) 0 where allowed, -inf elsewhere; out (Tb, group, hd)."""
    def run() -> None:
        group, count, hd = q.shape
        scores = q.reshape(group * count, hd) @ keys.T  # (group * Tb, L)
        scores *= np.float32(scale)
        scores.reshape(group, count, -1)[...] += bias
        attended = softmax(scores) @ values  # (group * Tb, hd)
        out[...] = attended.reshape(group, count, hd).transpose(1, 0, 2)
    return run


def head(norm: np.ndarray, eps: float, matrix: Any, x: np.ndarray, threads: int,
         dot: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """The final norm and the head product of x (rows, dim) (``Transformer.head_logits``'s
    torch path)."""
    follow_threads(1)
    normed = rms_norm(x, norm, eps)
    if out is None:
        out = np.empty((x.shape[0], matrix.shape[0]), np.float32)
    return product(normed, matrix, out, threads, dot)
