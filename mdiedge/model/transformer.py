"""A Llama-family decoder in plain torch; it knows nothing of sockets.

A ``Transformer`` holds a contiguous range of blocks ``[first, last)``, optionally the token
embedding and optionally the final norm and head, so a node of the ring runs exactly the code
that runs single-process. The KV cache has a slot dimension: a sample is a slot index, and
each row of a micro-batch carries its own slot and position ("rotating KV caches",
MDI-LLM, Macario et al. 2024).

References: Llama (Touvron et al. 2023), RoPE (Su et al. 2021), GQA (Ainslie et al. 2023),
SwiGLU (Shazeer 2020), Mixtral (Jiang et al. 2024).
"""
from __future__ import annotations

import functools
import itertools
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.accel import Twins
from . import _pystep
from ._stepspec import BlockWeights, QuantMatrix, StackedMatrix, plain
from .config import ModelConfig
from .exits import ExitStep
from .layers import (MLP, Linear, RMSNorm, apply_rope, fuse_layers, fused_with,
                     project_fused, rope_tables, transposed_head_pays)
from .fit import check_memory
from .moe import MoE

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
_SHORT_QUERY = 4096  # T * L below which explicit attention beats the fused CPU kernel
_NO_SLOTS = torch.empty(0, dtype=torch.long)
try:
    from . import _cstep
except ImportError:  # not built: the twin serves
    _cstep = None  # type: ignore[assignment]
STEP = Twins(_pystep, _cstep)
_step = STEP.select()


class KVCache(nn.Module):
    """Preallocated keys and values of one block for ``n_slots`` samples, KV heads only."""

    def __init__(self, n_slots: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (n_slots, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots: Tensor, positions: Sequence[int], k: Tensor, v: Tensor
               ) -> Tuple[Tensor, Tensor]:
        """Write k, v ``(B, kv_heads, T, head_dim)`` at each row's slot and position; return
        the keys and values of those slots up to the furthest position written."""
        batch, _, seq_len, _ = k.shape
        length = max(positions) + seq_len
        if batch == 1:
            slot = int(slots[0])
            pos = positions[0]
            self.k[slot, :, pos:pos + seq_len] = k[0]
            self.v[slot, :, pos:pos + seq_len] = v[0]
            return self.k[slot:slot + 1, :, :length], self.v[slot:slot + 1, :, :length]
        if seq_len == 1:
            pos_index = torch.as_tensor(positions, device=k.device)
            self.k[slots, :, pos_index] = k[:, :, 0]
            self.v[slots, :, pos_index] = v[:, :, 0]
        else:
            for row, pos in enumerate(positions):
                slot = int(slots[row])
                self.k[slot, :, pos:pos + seq_len] = k[row]
                self.v[slot, :, pos:pos + seq_len] = v[row]
        first = int(slots[0]) if slots.device.type == "cpu" else -1  # no device sync
        if first >= 0 and slots.tolist() == list(range(first, first + batch)):  # no copy
            return self.k[first:first + batch, :, :length], self.v[first:first + batch, :, :length]
        return (self.k[:, :, :length].index_select(0, slots),
                self.v[:, :, :length].index_select(0, slots))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
              causal: bool = False) -> Tensor:
    """q: (B, heads, T, hd); k, v: (B, kv_heads, L, hd); mask: (B, 1, T, L) bool or None;
    ``causal`` (no cache, T == L) masks the upper triangle instead.

    Short queries (decode) take a grouped matmul path that never copies K/V per query head;
    long ones (prefill, training) use the fused kernel where torch has one."""
    batch, n_heads, seq_len, head_dim = q.shape
    n_kv, length = k.shape[1], k.shape[2]
    groups = n_heads // n_kv
    if _HAS_SDPA and seq_len * length > _SHORT_QUERY:
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)  # (B, heads, L, hd)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    q = q.reshape(batch, n_kv, groups * seq_len, head_dim)  # (B, kv_heads, g*T, hd)
    scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(head_dim))  # (B, kv, g*T, L)
    if causal:
        mask = torch.ones(seq_len, length, dtype=torch.bool, device=q.device).tril()[None, None]
    if mask is not None:
        mask = mask.unsqueeze(2).expand(batch, 1, groups, seq_len, length)
        scores = scores.masked_fill(~mask.reshape(batch, 1, groups * seq_len, length), float("-inf"))
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v  # (B, kv_heads, g*T, hd)
    return out.view(batch, n_heads, seq_len, head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = Linear(cfg.dim, cfg.q_dim)
        self.wk = Linear(cfg.dim, cfg.kv_dim)
        self.wv = Linear(cfg.dim, cfg.kv_dim)
        self.wo = Linear(cfg.q_dim, cfg.dim)
        self.cache: Optional[KVCache] = None
        self.qkv: Optional[Any] = None  # see fuse_projections

    def fuse_projections(self) -> None:
        """Q, K and V as one product (``mdiedge.model.layers.fuse_layers``: float ones, or
        quantized ones, each of its own type)."""
        self.qkv = fuse_layers([self.wq, self.wk, self.wv])

    def _project_qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """q (B, T, q_dim), k and v (B, T, kv_dim) of x (B, T, dim)."""
        if fused_with(self.qkv, self.wq):
            out = project_fused(x, self.qkv)  # (B, T, q_dim + 2 * kv_dim)
            q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            return out[..., :q_dim], out[..., q_dim:q_dim + kv_dim], out[..., q_dim + kv_dim:]
        return self.wq(x), self.wk(x), self.wv(x)

    def fill_kv(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor,
                positions: Sequence[int]) -> None:
        """Write the keys and values of ``x`` (B, T, dim), already normed, at each row's slot
        and position, as ``forward`` would, without computing the attention."""
        batch, seq_len, _ = x.shape
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        assert self.cache is not None
        self.cache.update(slots, positions, apply_rope(k, cos, sin), v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor],
                slots: Tensor, positions: Sequence[int]) -> Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self._project_qkv(x)
        q = q.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, heads, T, hd)
        if self.cache is None:  # training: the whole sequence at once, causal
            out = attention(q, k, v, None, causal=True)
        else:
            keys, values = self.cache.update(slots, positions, k, v)  # (B, kv_heads, L, hd)
            out = attention(q, keys, values, mask)  # (B, heads, T, hd)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.mlp = _feed_forward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor],
                slots: Tensor, positions: Sequence[int]) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, slots, positions)
        return x + self.mlp(self.mlp_norm(x))

    def step_weights(self, cos: Tensor, sin: Tensor) -> Optional[BlockWeights]:
        """This block's tensors for the compiled decode step (``mdiedge.model._cstep``), with
        RoPE tables ``cos``, ``sin`` (L, hd); float32 or quantized matrices (``QuantMatrix``)
        each; None where the step does not apply (a mixture of experts, unfused projections,
        float beside quantized layers in Q/K/V or gate/up, no KV cache)."""
        attn, mlp = self.attn, self.mlp
        if (not isinstance(mlp, MLP) or attn.cache is None or not fused_with(attn.qkv, attn.wq)
                or not fused_with(mlp.gate_up, mlp.gate)):
            return None
        matrices = [step_matrix(m) for m in (attn.qkv, attn.wo, mlp.gate_up, mlp.down)]
        tensors = (self.attn_norm.weight, self.mlp_norm.weight, attn.cache.k, attn.cache.v,
                   cos, sin)
        if any(m is None for m in matrices) or not all(plain(t) for t in tensors):
            return None
        qkv, wo, gate_up, down = matrices
        return BlockWeights(self.attn_norm.weight, qkv, wo, self.mlp_norm.weight, gate_up, down,
                            attn.cache.k, attn.cache.v, cos, sin, attn.n_heads,
                            self.attn_norm.eps)


def step_matrix(held: Any) -> Optional[Any]:
    """A matrix as the compiled step reads it: a float buffer or a float layer's weight when
    plain float32, a quantized layer's blocks as a ``QuantMatrix``, a group of quantized
    layers (``qlayers.QuantGroup``) as a ``StackedMatrix``; else None."""
    group = getattr(held, "layers", None)
    if group is not None:
        parts = [step_matrix(layer) for layer in group]
        if not all(isinstance(part, QuantMatrix) for part in parts):
            return None
        try:
            return StackedMatrix(parts)
        except ValueError:  # more parts than the step takes
            return None
    qweight = getattr(held, "qweight", None)
    if qweight is not None:
        try:
            return QuantMatrix(qweight, held.qtype)
        except ValueError:  # on another device, or a type the step has no kernel for
            return None
    weight = held if isinstance(held, Tensor) else getattr(held, "weight", None)
    return weight if isinstance(weight, Tensor) and plain(weight) else None


def _feed_forward(cfg: ModelConfig) -> nn.Module:
    if cfg.is_moe:
        return MoE(cfg)
    return MLP(cfg.dim, cfg.intermediate_size)


class Transformer(nn.Module):
    """Blocks ``[first, last)`` of a decoder, with the embedding and the head each optional.

    Parameter names: ``embed.weight``, ``layers.{i}.…`` with the global block index ``i``,
    ``norm.weight``, ``lm_head.weight`` (see ``checkpoint.HF_NAMES``).
    """

    def __init__(self, cfg: ModelConfig, layers: Optional[Tuple[int, int]] = None,
                 embedding: bool = True, head: bool = True) -> None:
        super().__init__()
        first, last = layers if layers is not None else (0, cfg.n_layers)
        if not 0 <= first <= last <= cfg.n_layers:
            raise ValueError(f"layer range [{first}, {last}) outside 0..{cfg.n_layers}")
        self.cfg, self.first, self.last = cfg, first, last
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim) if embedding else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(first, last)})
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps) if head else None
        self.lm_head = Linear(cfg.dim, cfg.vocab_size) if head else None
        self.n_slots = 0
        self.max_seq_len = 0
        self.rope_cos = self.rope_sin = torch.empty(0)
        self._steps: Optional[List[BlockWeights]] = None  # see _step_weights
        self._plans: Dict[Tuple[int, int], Any] = {}
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings and isinstance(self.embed, nn.Embedding) and \
                isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed.weight

    def store_head_transposed(self) -> None:
        """Keep the head's weight, shape ``(vocab, dim)``, in column-major storage: a
        contiguous ``(dim, vocab)`` buffer, seen transposed. Values and shape are unchanged,
        but ``x @ W^T`` then streams the weight in the order CPU BLAS runs fastest for the
        one-row decode product (``bin/bench-decode`` measures it) and no slower for a prefill.
        A tied embedding shares it; its row lookups read strided. Nothing is done where the
        compiled few-row product (``mdiedge.model.layers``) runs decode: it reads row-major."""
        if not transposed_head_pays():
            return
        if not isinstance(self.lm_head, Linear) or not self.lm_head.weight.is_contiguous():
            return
        weight = self.lm_head.weight
        storage = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype,
                              device=weight.device)  # (dim, vocab)
        storage.copy_(weight.detach().t())
        self.lm_head.weight = nn.Parameter(storage.t(), requires_grad=weight.requires_grad)
        if self.embed is not None and self.embed.weight is weight:  # tied
            self.embed.weight = self.lm_head.weight

    def fuse_projections(self) -> None:
        """Q/K/V and the feed-forward's gate/up each as one product per block, sharing their
        parameters' memory (see ``layers.fuse``); for inference on the CPU, before loading."""
        self._steps = None
        for block in self.layers.values():
            block.attn.fuse_projections()
            for mlp in [block.mlp] if isinstance(block.mlp, MLP) else block.mlp.experts:
                mlp.fuse_projections()

    @property
    def has_embedding(self) -> bool:
        return self.embed is not None

    @property
    def has_head(self) -> bool:
        return self.lm_head is not None

    def setup_cache(self, n_slots: int, max_seq_len: Optional[int] = None) -> None:
        """Preallocate KV for ``n_slots`` samples of up to ``max_seq_len`` tokens."""
        max_seq_len = max_seq_len or self.cfg.max_seq_len
        param = next(self.parameters())
        dtype, device = param.dtype, param.device
        for block in self.layers.values():  # the old cache's memory is free for the new
            block.attn.cache = None
        need = 2 * n_slots * self.cfg.kv_dim * max_seq_len * param.element_size() * \
            len(self.layers)
        check_memory(need, str(device), f"a KV cache of {n_slots} slots x {max_seq_len} "
                     f"tokens for blocks [{self.first}, {self.last})",
                     "fewer samples (slots) or a shorter context")
        for block in self.layers.values():
            block.attn.cache = KVCache(n_slots, self.cfg.n_kv_heads, max_seq_len,
                                       self.cfg.head_dim, dtype, device)
        cos, sin = rope_tables(self.cfg, max_seq_len)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self.n_slots, self.max_seq_len = n_slots, max_seq_len
        self._steps = None

    def kv_cache_bytes(self) -> int:
        return sum(b.attn.cache.k.nbytes * 2 for b in self.layers.values()
                   if b.attn.cache is not None)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        if self.embed is None:
            raise RuntimeError("this chunk holds no embedding")
        if not isinstance(self.embed, nn.Embedding):  # quantized rows
            return self.embed(tokens)  # (…, dim)
        return F.embedding(tokens, self.embed.weight)  # (…, dim)

    def run_blocks(self, x: Tensor, slots: Tensor, positions: Sequence[int],
                   exit_step: Optional[ExitStep] = None) -> Tensor:
        """x: (B, T, dim) hidden states; row b starts at ``positions[b]`` in slot ``slots[b]``.

        With ``exit_step`` (decode), the criterion runs after each block; once the step has
        exited (here or on an earlier node), the remaining blocks only fill their KV from
        the exit state, which is returned."""
        if not self.layers:
            return x
        if self.n_slots == 0:
            return self._run_blocks_uncached(x)
        if (_step.PREFERRED and x.shape[1] == 1 and x.shape[0] <= _step.MAX_ROWS
                and x.device.type == "cpu"):
            stepped = self._step_blocks(x, slots, positions, exit_step)
            if stepped is not None:
                return stepped
        cos, sin, mask = self._rope_and_mask(x, positions)
        blocks = list(self.layers.items())
        for n, (index, block) in enumerate(blocks):
            previous = x
            x = block(x, cos, sin, mask, slots, positions)
            if exit_step is not None and exit_step.after_block(int(index), x, previous):
                t0 = time.perf_counter()
                self._fill_from(n + 1, x, slots, positions)
                exit_step.fill_s += time.perf_counter() - t0
                break
        return x

    def _step_blocks(self, x: Tensor, slots: Tensor, positions: Sequence[int],
                     exit_step: Optional[ExitStep]) -> Optional[Tensor]:
        """Decode (one token per row, x (B, 1, dim)) through the compiled step: every block
        in one call, or, with ``exit_step``, the blocks between two checked ones in one call,
        each checked block in its own, and early exit as in ``run_blocks``. None, before
        anything runs, where the step does not apply to every block."""
        weights = self._step_weights()
        rows = x.reshape(x.shape[0], x.shape[2])  # (B, dim)
        if not weights or not _step.usable(weights[0], rows):
            return None
        if max(positions) + 1 > self.max_seq_len:
            raise ValueError(f"position {max(positions) + 1} beyond the KV cache "
                             f"length {self.max_seq_len}")
        run = functools.partial(self._step_run, slots=slots.tolist(), positions=positions,
                                threads=torch.get_num_threads())
        if exit_step is None:
            return run(0, len(weights), rows)[:, None]
        indices = [int(i) for i in self.layers]
        start = 0
        for n, index in enumerate(indices):
            if not exit_step.policy.checks(index):
                continue
            previous = run(start, n, rows) if n > start else rows
            rows, start = run(n, n + 1, previous), n + 1
            if exit_step.after_block(index, rows[:, None], previous[:, None]):
                t0 = time.perf_counter()
                self._fill_from(n + 1, rows[:, None], slots, positions)
                exit_step.fill_s += time.perf_counter() - t0
                return rows[:, None]
        return (run(start, len(indices), rows) if start < len(indices) else rows)[:, None]

    def _step_run(self, first: int, end: int, rows: Tensor, slots: List[int],
                  positions: Sequence[int], threads: int) -> Tensor:
        """This chunk's blocks ``first`` to ``end`` (positions in the chunk) on rows (B, dim)
        in one call of the step; their plan is made once."""
        plans = self._plans
        plan = plans.get((first, end))
        if plan is None:
            plan = plans[(first, end)] = _step.plan(self._step_weights()[first:end])
        out = torch.empty_like(rows)  # (B, dim)
        _step.blocks(plan, rows, out, slots, positions, threads)
        return out

    def _step_weights(self) -> List[BlockWeights]:
        """Every block's ``step_weights`` (empty unless all have them), made once per KV cache
        set-up, with the step's plans of them (``_plans``): ``setup_cache``,
        ``fuse_projections`` and any ``.to()`` make them again. A parameter replaced by hand
        after ``setup_cache`` needs ``setup_cache`` again."""
        if self._steps is None:
            found = [b.step_weights(self.rope_cos, self.rope_sin) for b in self.layers.values()]
            self._steps = [] if any(w is None for w in found) else found  # type: ignore[misc]
            self._plans = {}
        return self._steps

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "Transformer":
        self._steps = None  # tensors moved or converted
        return super()._apply(fn, *args, **kwargs)

    def _fill_from(self, start: int, x: Tensor, slots: Tensor, positions: Sequence[int]) -> None:
        """KV fill of this chunk's blocks from the ``start``-th on (early exit)."""
        cos, sin, _ = self._rope_and_mask(x, positions)
        for skipped in list(self.layers.values())[start:]:
            skipped.attn.fill_kv(skipped.attn_norm(x), cos, sin, slots, positions)

    def fill_kv(self, x: Tensor, slots: Tensor, positions: Sequence[int]) -> None:
        """KV fill (early exit): every block of this chunk writes the keys and values its own
        norm and K/V projections make of ``x`` (B, T, dim), the exit state, at each row's slot
        and position; nothing else runs."""
        if self.layers:
            self._fill_from(0, x, slots, positions)

    def _rope_and_mask(self, x: Tensor, positions: Sequence[int]
                       ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """RoPE tables (B, 1, T, hd) of the rows' positions, and the attention mask
        (B, 1, T, L) (None for one token per row at one position: each sees its whole cache)."""
        batch, seq_len, _ = x.shape
        if max(positions) + seq_len > self.max_seq_len:
            raise ValueError(f"position {max(positions) + seq_len} beyond the KV cache "
                             f"length {self.max_seq_len}")
        device = x.device
        offsets = torch.arange(seq_len, device=device)
        starts = torch.as_tensor(positions, device=device)
        query_pos = starts[:, None] + offsets  # (B, T)
        cos = self.rope_cos[query_pos].unsqueeze(1)  # (B, 1, T, hd)
        sin = self.rope_sin[query_pos].unsqueeze(1)
        mask: Optional[Tensor] = None
        if not (seq_len == 1 and min(positions) == max(positions)):  # else all keys are seen
            key_pos = torch.arange(max(positions) + seq_len, device=device)
            mask = (key_pos <= query_pos[..., None]).unsqueeze(1)  # (B, 1, T, L)
        return cos, sin, mask

    def hidden_states(self, tokens: Tensor) -> List[Tensor]:
        """Every block's output, each (B, T, dim), for whole sequences from position 0 without
        a KV cache (training and calibration of early exits): element i is block first + i's."""
        states: List[Tensor] = []
        self._run_blocks_uncached(self.embed_tokens(tokens), states)
        return states

    def _run_blocks_uncached(self, x: Tensor, states: Optional[List[Tensor]] = None) -> Tensor:
        """Causal forward over whole sequences from position 0, without a KV cache (training);
        each block's output is appended to ``states`` when given."""
        seq_len = x.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq_len} beyond max_seq_len {self.cfg.max_seq_len}")
        if getattr(self, "_train_rope_len", 0) < seq_len or self.rope_cos.device != x.device:
            cos, sin = rope_tables(self.cfg, seq_len)
            self.rope_cos, self.rope_sin = cos.to(x.device), sin.to(x.device)
            self._train_rope_len = seq_len
        cos = self.rope_cos[None, None, :seq_len]  # (1, 1, T, hd)
        sin = self.rope_sin[None, None, :seq_len]
        for block in self.layers.values():
            x = block(x, cos, sin, None, _NO_SLOTS, ())
            if states is not None:
                states.append(x)
        return x

    def head_logits(self, x: Tensor) -> Tensor:
        """Final norm and head: (…, dim) -> (…, vocab) in fp32. Decode rows (B, dim) on the
        CPU take the compiled step's one call for both, as the blocks do, a quantized head
        too."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("this chunk holds no head")
        if _step.PREFERRED and x.dim() == 2 and x.shape[0] <= _step.MAX_ROWS:
            rows, head = x.contiguous(), step_matrix(self.lm_head)  # (B, dim)
            norm = self.norm.weight
            if head is not None and _step.logits_usable(norm, head, rows):
                out = torch.empty(rows.shape[0], head.shape[0])  # (B, vocab)
                _step.logits(norm, self.norm.eps, head, rows, out, torch.get_num_threads())
                return out
        return self.lm_head(self.norm(x)).float()

    def forward(self, inputs: Tensor, slots: Tensor, positions: Sequence[int],
                all_logits: bool = False) -> Tensor:
        """inputs: token ids (B, T) with an embedding, else hidden states (B, T, dim).
        Returns logits (B, vocab) for the last position, (B, T, vocab) with ``all_logits``,
        or hidden states (B, T, dim) for a chunk without a head."""
        x = self.embed_tokens(inputs) if self.embed is not None else inputs
        x = self.run_blocks(x, slots, positions)
        if self.lm_head is None:
            return x
        return self.head_logits(x if all_logits else x[:, -1])

    def expert_load(self) -> Dict[str, List[int]]:
        """Tokens routed to each expert since loading, per MoE block of this chunk:
        ``{global block index: [count per expert]}`` (empty for a dense model)."""
        return {i: block.mlp.expert_counts.tolist() for i, block in self.layers.items()
                if hasattr(block.mlp, "expert_counts")}

    def parameter_bytes(self) -> int:
        """Bytes of the weights as held: float parameters and quantized blocks."""
        seen: Dict[int, int] = {}
        for p in itertools.chain(self.parameters(), (m.qweight for m in self.modules()
                                                     if hasattr(m, "qweight"))):
            seen[id(p)] = p.numel() * p.element_size()
        return sum(seen.values())
