"""A chunk of a decoder on numpy buffers and the compiled step, without torch: the model
chunk the runtime calls on a CPU node (the torch ``Transformer``'s members, numpy in and
out; ``mdiedge.model.cpuload`` builds it).

Blocks ``[first, last)`` run through the step's ``blocks`` plan (``mdiedge.model.
_stepconstants``) where each sample's rows are few (decode, speculation's verified rows),
``STEP_ROWS`` rows a call (``decode_pieces``): the step writes every row's keys and values
before any row attends, each up to its own position, so the rows of one slot see each other
causally. A sample's longer runs (a prefill), or every call where the step is the
pure-Python twin, run on numpy (``mdiedge.model.npprefill``):
the calls and the arithmetic the torch model sends through the step and through torch. The
head likewise; embeddings are looked up row by row, a quantized table's rows de-quantized
only when asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..base.cpudot import dot_code
from ..base.errors import CpuPathRefused
from ..base.memory import zeroed_pages
from ..base.threads import kernel_threads
from . import npprefill
from ._stepconstants import STEP_ROWS, BlockWeights, Experts, QuantMatrix, decode_pieces
from .checks import check_memory
from .config import ModelConfig
from .families import family_of
from .kernels import QUANT, STEP
from .rope import GrowingRope

_step = STEP.select()
_quant = QUANT.select()


@dataclass
class BlockParts:
    """One block's tensors as the step reads them, before its caches exist: float32 numpy
    vectors, matrices float32 or ``QuantMatrix``/``StackedMatrix``; ``experts`` (router,
    gate_ups, downs) of a mixture of experts, gate_up and down then None; ``options`` the
    ``BlockWeights`` keywords the block has."""

    attn_norm: np.ndarray
    qkv: Any
    wo: Any
    mlp_norm: np.ndarray
    gate_up: Any
    down: Any
    experts: Optional[Tuple[Any, List[Any], List[Any]]]
    options: Dict[str, Any]
    counts: Optional[np.ndarray] = None

    def matrices(self) -> List[Any]:
        found = [self.qkv, self.wo, self.gate_up, self.down]
        if self.experts is not None:
            router, gate_up, down = self.experts
            found += [router] + list(gate_up) + list(down)
        found += [v for v in self.options.values() if isinstance(v, np.ndarray)]
        return [m for m in found if m is not None] + [self.attn_norm, self.mlp_norm]


@dataclass
class Weights:
    """A chunk's weights: the embedding (None: not held), its blocks, the final norm and
    head (None: not held; the head None beside a norm: the tied embedding)."""

    embed: Any
    blocks: List[BlockParts]
    norm: Optional[np.ndarray]
    head: Any


class CpuModel:
    """Blocks ``[first, last)`` of a decoder with the embedding and the head each optional,
    on numpy buffers: the runtime's model chunk where torch is not loaded."""

    takes_numpy = True

    def __init__(self, cfg: ModelConfig, layers: Tuple[int, int], weights: Weights) -> None:
        self.cfg = cfg
        self.first, self.last = layers
        self.family = family_of(cfg)
        self.weights = weights
        self._head = weights.head if weights.head is not None else weights.embed
        if weights.norm is not None and self._head is None:
            raise CpuPathRefused("a tied head needs the embedding in the same chunk")
        self.n_slots = self.max_seq_len = 0
        self.caches: List[Tuple[np.ndarray, np.ndarray]] = []
        self._plan: Any = None
        self._tables: List[Tuple[np.ndarray, np.ndarray]] = []
        self._ropes: Dict[int, GrowingRope] = {}  # 1: the sliding layers' own
        for parts in weights.blocks:
            if parts.experts is not None and parts.counts is None:
                parts.counts = np.zeros(len(parts.experts[1]), dtype=np.int64)

    @property
    def has_embedding(self) -> bool:
        return self.weights.embed is not None

    @property
    def has_head(self) -> bool:
        return self.weights.norm is not None

    @property
    def decode_route(self) -> Dict[str, str]:
        """Where decode runs (``decoderoute.decode_route``'s form): the compiled step for every
        part, or numpy (``npprefill``) where the step is not built, with the reason."""
        where = "step" if _step.PREFERRED else "numpy"
        route = {"blocks": where} if self.weights.blocks else {}
        route = dict(route, head=where) if self.has_head else route
        if route and where == "numpy":
            route["reason"] = "the compiled step is not built (numpy decodes, slowly)"
        return route

    def setup_cache(self, n_slots: int, max_seq_len: Optional[int] = None) -> None:
        """Preallocate KV for ``n_slots`` samples of up to ``max_seq_len`` tokens."""
        max_seq_len = max_seq_len or self.cfg.max_seq_len
        self.caches, self._plan = [], None  # the old cache's memory is free for the new
        shape = (n_slots, self.cfg.n_kv_heads, max_seq_len, self.cfg.head_dim)
        dtype = kv_dtype(dot_code())
        need = 2 * dtype.itemsize * int(np.prod(shape)) * len(self.weights.blocks)
        check_memory(need, "cpu", f"a KV cache of {n_slots} slots x {max_seq_len} tokens for "
                     f"blocks [{self.first}, {self.last})",
                     "fewer samples (slots) or a shorter context")
        self._ropes = {0: GrowingRope(self.cfg, max_seq_len)}
        windows = {p.options.get("window", 0) for p in self.weights.blocks}
        if self.cfg.rope_local_theta and any(windows):
            self._ropes[1] = GrowingRope(self.cfg, max_seq_len, local=True)
        made, self._tables = [], []
        for parts in self.weights.blocks:
            k, v = _zeros(shape, dtype), _zeros(shape, dtype)
            self.caches.append((k, v))
            rope = self._ropes[1 if parts.options.get("window", 0) and 1 in self._ropes else 0]
            cos, sin = rope.cos, rope.sin
            self._tables.append((cos, sin))
            made.append(_block_weights(parts, k, v, cos, sin, self.cfg))
        self._plan = _step.plan(made) if made else None
        self.n_slots, self.max_seq_len = n_slots, max_seq_len

    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    def parameter_bytes(self) -> int:
        """Bytes of the weights as held: float arrays and quantized blocks, each once."""
        held: Dict[int, int] = {}
        w = self.weights
        for m in [w.embed, w.norm, w.head] + [m for p in w.blocks for m in p.matrices()]:
            for part in getattr(m, "parts", (m,)):
                array = part.data if isinstance(part, QuantMatrix) else part
                if array is not None:
                    held[id(array)] = array.nbytes
        return sum(held.values())

    def embed_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Token ids (B, T) int64 -> float32 (B, T, dim)."""
        table = self.weights.embed
        if table is None:
            raise RuntimeError("this chunk holds no embedding")
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise IndexError(f"token id {int(ids.max() if ids.max() >= 0 else ids.min())} "
                             f"outside the vocabulary of {self.cfg.vocab_size}")
        if isinstance(table, QuantMatrix):
            flat = ids.reshape(-1)
            x = np.empty((flat.shape[0], self.cfg.dim), np.float32)
            for i, token in enumerate(flat.tolist()):
                _quant.dequantize_rows(table.data, table.qtype, token, 1, x[i:i + 1], 1)
            x = x.reshape(*ids.shape, self.cfg.dim)
        else:
            x = table[ids]
        if self.family.embed_scaled:
            x = x * np.float32(self.cfg.dim ** 0.5)
        return np.ascontiguousarray(x, dtype=np.float32)

    def run_blocks(self, x: np.ndarray, slots: Any, positions: Sequence[int],
                   step: Any = None) -> np.ndarray:
        """x (B, T, dim) float32; row b's T tokens at positions ``positions[b]``.. in KV slot
        ``slots[b]``. Up to ``MAX_ROWS`` rows each (decode, verification) through the step,
        ``STEP_ROWS`` rows a call however many samples; longer (prefill) on numpy
        (``npprefill``), as the torch model takes torch for them."""
        assert step is None, "early exit runs on the torch path"
        if not self.weights.blocks:
            return x
        if self._plan is None:
            raise RuntimeError("no KV cache set up (setup_cache)")
        batch, seq_len, dim = x.shape
        end = max(positions) + seq_len
        if end > self.max_seq_len:
            raise ValueError(f"position {end} beyond the KV cache length {self.max_seq_len}")
        for rope in self._ropes.values():
            rope.cover(end)
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(batch * seq_len, dim)
        slot_list = [int(s) for s in np.asarray(slots).reshape(-1)]
        threads, dot = kernel_threads(), dot_code()
        pieces = decode_pieces(batch, seq_len) if _step.PREFERRED else None
        if pieces is None:
            calls = npprefill.Rows(batch, seq_len, slot_list, [int(p) for p in positions],
                                   threads, dot)
            out = npprefill.run_blocks(self.cfg, self.weights.blocks, self.caches,
                                       self._tables, rows, calls)
            return out.reshape(batch, seq_len, dim)
        out = np.empty_like(rows)
        row_slots = [s for s in slot_list for _ in range(seq_len)]
        row_positions = [int(p) + t for p in positions for t in range(seq_len)]
        for start, end in pieces:
            _step.blocks(self._plan, rows[start:end], out[start:end], row_slots[start:end],
                         row_positions[start:end], threads, dot)
        return out.reshape(batch, seq_len, dim)

    def fill_kv(self, x: np.ndarray, slots: Any, positions: Sequence[int]) -> None:
        raise NotImplementedError("KV fill (early exit) runs on the torch path")

    def head_logits(self, x: np.ndarray) -> np.ndarray:
        """Final norm and head: (…, dim) float32 -> (…, vocab) float32; decode rows (B, dim),
        up to ``STEP_ROWS``, in one call of the step, anything else (more rows: a prefill's,
        a perplexity's) on numpy, as the torch model takes the step or torch for them."""
        if self.weights.norm is None:
            raise RuntimeError("this chunk holds no head")
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self.cfg.dim)
        vocab = self._head.shape[0]
        out = np.empty((rows.shape[0], vocab), np.float32)
        threads, dot = kernel_threads(), dot_code()
        if _step.PREFERRED and x.ndim == 2 and rows.shape[0] <= STEP_ROWS:
            _step.logits(self.weights.norm, self.cfg.rms_norm_eps, self._head, rows, out,
                         threads, dot)
        else:
            npprefill.head(self.weights.norm, self.cfg.rms_norm_eps, self._head, rows,
                           threads, dot, out)
        return out.reshape(*x.shape[:-1], vocab)

    def expert_load(self) -> Dict[str, List[int]]:
        """Tokens routed to each expert since loading, per MoE block of this chunk."""
        return {str(self.first + i): p.counts.tolist()
                for i, p in enumerate(self.weights.blocks) if p.counts is not None}


def kv_dtype(dot: int) -> np.dtype:
    """The KV cache's element type: float16 in the q8 mode (``dot``), as llama.cpp's cache
    (half the memory, and the bytes attention reads), float32 in the exact f32 mode."""
    return np.dtype(np.float16 if dot else np.float32)


def _zeros(shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A KV array of zeros whose pages become resident as tokens are written
    (``memory.zeroed_pages``)."""
    count = int(np.prod(shape))
    return np.frombuffer(zeroed_pages(dtype.itemsize * count), dtype, count).reshape(shape)


def _block_weights(parts: BlockParts, k: np.ndarray, v: np.ndarray, cos: np.ndarray,
                   sin: np.ndarray, cfg: ModelConfig) -> BlockWeights:
    """The step's ``BlockWeights`` of one block with its caches and RoPE tables;
    ``CpuPathRefused`` quoting what the step refuses."""
    experts = None
    if parts.experts is not None:
        router, gate_up, down = parts.experts
        try:
            experts = Experts(router, gate_up, down, cfg.experts_per_token,
                              cfg.norm_topk_prob, parts.counts)
        except ValueError as e:
            raise CpuPathRefused(f"the step refuses the experts: {e}") from None
    try:
        return BlockWeights(parts.attn_norm, parts.qkv, parts.wo, parts.mlp_norm,
                            parts.gate_up, parts.down, k, v, cos, sin, cfg.n_heads,
                            cfg.rms_norm_eps, experts=experts, **parts.options)
    except ValueError as e:
        raise CpuPathRefused(f"the step refuses a block: {e}") from None
