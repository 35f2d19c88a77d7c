"""A decoder in plain torch; it knows nothing of sockets.

A ``Transformer`` holds blocks ``[first, last)`` and optionally the embedding, final norm and head,
so a ring node runs the single-process code. The KV cache has a slot dimension: each row carries its
own slot and position (MDI-LLM's "rotating KV caches"). Decode takes the compiled step for the parts
the family declares, torch for the rest."""
from __future__ import annotations

import functools
import itertools
import time
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._stepconstants import STEP_ROWS, BlockWeights, decode_pieces
from .block import KVCache, step_matrix
from .config import ModelConfig
from ..base.cpudot import dot_code
from .decoderoute import decode_route
from .earlyexit.policy import ExitStep
from .families import family_of
from .kernels import STEP
from .checks import check_memory
from .layers import Linear, RMSNorm, rope_tables, transposed_head_pays

NO_SLOTS = torch.empty(0, dtype=torch.long)
_step = STEP.select()


def step_code() -> ModuleType:
    """The step module decode runs through (compiled, or its twin)."""
    return _step


class Transformer(nn.Module):
    """Parameter names: ``embed.weight``, ``layers.{i}.…`` with the global block index ``i``,
    ``norm.weight``, ``lm_head.weight`` (``tensors.tensor_plan`` maps them to a checkpoint's)."""

    def __init__(self, cfg: ModelConfig, layers: Optional[Tuple[int, int]] = None,
                 embedding: bool = True, head: bool = True) -> None:
        super().__init__()
        first, last = layers if layers is not None else (0, cfg.n_layers)
        if not 0 <= first <= last <= cfg.n_layers:
            raise ValueError(f"layer range [{first}, {last}) outside 0..{cfg.n_layers}")
        self.cfg, self.first, self.last = cfg, first, last
        self.family = family_of(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim) if embedding else None
        self.layers = nn.ModuleDict({str(i): self.family.make_block(cfg, i)
                                     for i in range(first, last)})
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps) if head else None
        self.lm_head = Linear(cfg.dim, cfg.vocab_size) if head else None
        self.n_slots = 0
        self.max_seq_len = 0
        self.rope_cos = self.rope_sin = torch.empty(0)
        self.local_rope_cos = self.local_rope_sin = self.rope_cos  # see _set_rope
        self._steps: Optional[List[BlockWeights]] = None  # see _step_weights
        self._plans: Dict[Tuple[int, int], Any] = {}
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings and isinstance(self.embed, nn.Embedding) and \
                isinstance(self.lm_head, Linear):
            self.lm_head.weight = self.embed.weight

    def store_head_transposed(self) -> None:
        """Keep the head weight column-major: CPU BLAS streams it fastest so for the one-row decode
        product (``bin/bench-decode``). Skipped where the compiled few-row product runs decode (it
        reads row-major)."""
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
        """Q/K/V and gate/up each as one product sharing their parameters' memory; CPU inference,
        before loading."""
        self._steps = None
        for block in self.layers.values():
            block.fuse_projections()

    @property
    def has_embedding(self) -> bool:
        return self.embed is not None

    @property
    def has_head(self) -> bool:
        return self.lm_head is not None

    def setup_cache(self, n_slots: int, max_seq_len: Optional[int] = None) -> None:
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
        self._set_rope(max_seq_len, device)
        self.n_slots, self.max_seq_len = n_slots, max_seq_len
        self._steps = None

    def _set_rope(self, length: int, device: torch.device) -> None:
        """RoPE tables of ``length`` positions: global (``rope_*``) and sliding (``local_rope_*``,
        the same unless their base differs)."""
        cos, sin = rope_tables(self.cfg, length)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self.local_rope_cos, self.local_rope_sin = self.rope_cos, self.rope_sin
        if self.cfg.rope_local_theta and any(self._windows()):
            cos, sin = rope_tables(self.cfg, length, local=True)
            self.local_rope_cos, self.local_rope_sin = cos.to(device), sin.to(device)

    def _windows(self) -> List[int]:
        """Attention windows of this chunk's blocks, each once (0: full)."""
        return sorted({block.attn.window for block in self.layers.values()})

    def _tables(self, window: int) -> Tuple[Tensor, Tensor]:
        return (self.local_rope_cos, self.local_rope_sin) if window else (self.rope_cos,
                                                                          self.rope_sin)

    def kv_cache_bytes(self) -> int:
        return sum(b.attn.cache.k.nbytes * 2 for b in self.layers.values()
                   if b.attn.cache is not None)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        if self.embed is None:
            raise RuntimeError("this chunk holds no embedding")
        if not isinstance(self.embed, nn.Embedding):  # quantized rows
            x = self.embed(tokens)  # (…, dim)
        else:
            x = F.embedding(tokens, self.embed.weight)  # (…, dim)
        if self.family.embed_scaled:
            return x * torch.tensor(self.cfg.dim ** 0.5, dtype=x.dtype, device=x.device)
        return x

    def run_blocks(self, x: Tensor, slots: Tensor, positions: Sequence[int],
                   exit_step: Optional[ExitStep] = None) -> Tensor:
        """x: (B, T, dim); row b starts at ``positions[b]`` in slot ``slots[b]``. With ``exit_step``
        (decode) the criterion runs after each block; once exited (here or on an earlier node) the
        remaining blocks only fill their KV from the exit state, which is returned."""
        if not self.layers:
            return x
        if self.n_slots == 0:
            return self._run_blocks_uncached(x)
        pieces = decode_pieces(x.shape[0], x.shape[1]) \
            if _step.PREFERRED and x.device.type == "cpu" else None
        if pieces is not None and (exit_step is None or (len(pieces) == 1 and x.shape[1] == 1)):
            stepped = self._step_blocks(x, slots, positions, exit_step, pieces)
            if stepped is not None:
                return stepped
        inputs = self._attention_inputs(x, positions)
        blocks = list(self.layers.items())
        for n, (index, block) in enumerate(blocks):
            previous = x
            x = block(x, *inputs[block.attn.window], slots, positions)
            if exit_step is not None and exit_step.after_block(int(index), x, previous):
                t0 = time.perf_counter()
                self._fill_from(n + 1, x, slots, positions)
                exit_step.fill_s += time.perf_counter() - t0
                break
        return x

    def _step_blocks(self, x: Tensor, slots: Tensor, positions: Sequence[int],
                     exit_step: Optional[ExitStep],
                     pieces: List[Tuple[int, int]]) -> Optional[Tensor]:
        """Decode through the compiled step, every block in one call for each of ``pieces``
        (``decode_pieces``' row ranges), or with ``exit_step`` (T = 1, one piece) the blocks
        between checked ones. A row's T positions all write KV before any attends, so they see
        each other causally. None, before anything runs, where the step does not cover every
        block."""
        weights = self._step_weights()
        batch, seq_len, dim = x.shape
        rows = x.reshape(batch * seq_len, dim)  # (B*T, dim)
        if not weights or not _step.usable(weights[0], rows[:STEP_ROWS]):
            return None
        if max(positions) + seq_len > self.max_seq_len:
            raise ValueError(f"position {max(positions) + seq_len} beyond the KV cache "
                             f"length {self.max_seq_len}")
        slot_list = [s for s in slots.tolist() for _ in range(seq_len)]
        row_positions = [p + t for p in positions for t in range(seq_len)]
        threads = torch.get_num_threads()
        if exit_step is None:
            out = torch.empty_like(rows)  # (B*T, dim)
            for start, end in pieces:
                self._step_run(0, len(weights), rows[start:end], slot_list[start:end],
                               row_positions[start:end], threads, out[start:end])
            return out.view(batch, seq_len, dim)
        run = functools.partial(self._step_run, slots=slot_list, positions=row_positions,
                                threads=threads)
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
                  positions: Sequence[int], threads: int, out: Optional[Tensor] = None) -> Tensor:
        """Blocks [first, end) of ``rows`` through the step, into ``out`` (new where None)."""
        plans = self._plans
        plan = plans.get((first, end))
        if plan is None:
            plan = plans[(first, end)] = _step.plan(self._step_weights()[first:end])
        out = torch.empty_like(rows) if out is None else out  # (B, dim)
        _step.blocks(plan, rows, out, slots, positions, threads, dot_code())
        return out

    def _step_weights(self) -> List[BlockWeights]:
        """Every block's ``step_weights`` and plans, empty unless all blocks have them and the
        family declares ``step_blocks``. Made per ``setup_cache``, ``fuse_projections`` or
        ``.to()``: a parameter replaced by hand later needs ``setup_cache``."""
        if self._steps is None:
            found = [b.step_weights(*self._tables(b.attn.window)) for b in self.layers.values()
                     ] if self.family.step_blocks else []
            self._steps = [] if any(w is None for w in found) else found  # type: ignore[misc]
            self._plans = {}
        return self._steps

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "Transformer":
        self._steps = None  # tensors moved or converted
        return super()._apply(fn, *args, **kwargs)

    def _fill_from(self, start: int, x: Tensor, slots: Tensor, positions: Sequence[int]) -> None:
        inputs = self._attention_inputs(x, positions)
        for skipped in list(self.layers.values())[start:]:
            cos, sin, _ = inputs[skipped.attn.window]
            skipped.fill_kv(x, cos, sin, slots, positions)

    def fill_kv(self, x: Tensor, slots: Tensor, positions: Sequence[int]) -> None:
        """KV fill (early exit): every block writes the keys and values of the exit state ``x``;
        nothing else runs."""
        if self.layers:
            self._fill_from(0, x, slots, positions)

    def _attention_inputs(self, x: Tensor, positions: Sequence[int]
                          ) -> Dict[int, Tuple[Tensor, Tensor, Optional[Tensor]]]:
        return {window: rope_and_mask(x, positions, self._tables(window), window,
                                      self.max_seq_len) for window in self._windows()}

    def hidden_states(self, tokens: Tensor) -> List[Tensor]:
        """Every block's output (B, T, dim) for whole sequences without a KV cache (training,
        early-exit calibration)."""
        states: List[Tensor] = []
        self._run_blocks_uncached(self.embed_tokens(tokens), states)
        return states

    def _run_blocks_uncached(self, x: Tensor, states: Optional[List[Tensor]] = None) -> Tensor:
        seq_len = x.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq_len} beyond max_seq_len {self.cfg.max_seq_len}")
        if getattr(self, "_train_rope_len", 0) < seq_len or self.rope_cos.device != x.device:
            self._set_rope(seq_len, x.device)
            self._train_rope_len = seq_len
        for block in self.layers.values():
            tables = self._tables(block.attn.window)
            cos, sin = (table[None, None, :seq_len] for table in tables)  # (1, 1, T, hd)
            x = block(x, cos, sin, None, NO_SLOTS, ())
            if states is not None:
                states.append(x)
        return x

    def head_logits(self, x: Tensor) -> Tensor:
        """Final norm and head, (…, dim) -> (…, vocab) fp32; CPU decode rows, up to
        ``STEP_ROWS``, take the compiled step where the family declares ``step_head``."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("this chunk holds no head")
        if self.family.step_head and _step.PREFERRED and x.dim() == 2 \
                and x.shape[0] <= STEP_ROWS:
            rows, head = x.contiguous(), step_matrix(self.lm_head)  # (B, dim)
            norm = self.norm.weight
            if head is not None and _step.logits_usable(norm, head, rows):
                out = torch.empty(rows.shape[0], head.shape[0])  # (B, vocab)
                _step.logits(norm, self.norm.eps, head, rows, out, torch.get_num_threads(),
                             dot_code())
                return out
        return self.lm_head(self.norm(x)).float()

    def forward(self, inputs: Tensor, slots: Tensor, positions: Sequence[int],
                all_logits: bool = False) -> Tensor:
        """inputs: token ids (B, T) with an embedding, else hidden states (B, T, dim). Logits (B,
        vocab) of the last position, (B, T, vocab) with ``all_logits``, or hidden states without a
        head."""
        x = self.embed_tokens(inputs) if self.embed is not None else inputs
        x = self.run_blocks(x, slots, positions)
        if self.lm_head is None:
            return x
        return self.head_logits(x if all_logits else x[:, -1])

    def expert_load(self) -> Dict[str, List[int]]:
        """Tokens routed to each expert since loading: ``{global block index: [count per expert]}``.
        """
        return {i: block.mlp.expert_counts.tolist() for i, block in self.layers.items()
                if hasattr(block.mlp, "expert_counts")}

    def parameter_bytes(self) -> int:
        """Float parameters and quantized blocks, as held."""
        seen: Dict[int, int] = {}
        for p in itertools.chain(self.parameters(), (m.qweight for m in self.modules()
                                                     if hasattr(m, "qweight"))):
            seen[id(p)] = p.numel() * p.element_size()
        return sum(seen.values())


def rope_and_mask(x: Tensor, positions: Sequence[int], tables: Tuple[Tensor, Tensor],
                  window: int, max_seq_len: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """RoPE ``tables`` at the rows' positions, (B, 1, T, hd) each, and the mask (B, 1, T, L): causal
    and, with ``window``, of the last ``window`` positions (None where every row sees its whole
    cache)."""
    batch, seq_len, _ = x.shape
    length = max(positions) + seq_len
    if length > max_seq_len:
        raise ValueError(f"position {length} beyond the KV cache length {max_seq_len}")
    device = x.device
    offsets = torch.arange(seq_len, device=device)
    starts = torch.as_tensor(positions, device=device)
    query_pos = starts[:, None] + offsets  # (B, T)
    cos = tables[0][query_pos].unsqueeze(1)  # (B, 1, T, hd)
    sin = tables[1][query_pos].unsqueeze(1)
    if seq_len == 1 and min(positions) == max(positions) and not 0 < window < length:
        return cos, sin, None
    key_pos = torch.arange(length, device=device)
    mask = key_pos <= query_pos[..., None]  # (B, T, L)
    if window:
        mask &= key_pos > query_pos[..., None] - window
    return cos, sin, mask.unsqueeze(1)  # (B, 1, T, L)


def route_of(model: Transformer) -> Dict[str, str]:
    """How a decode step of ``model`` runs here (``decoderoute``)."""
    return decode_route(model, _step)
