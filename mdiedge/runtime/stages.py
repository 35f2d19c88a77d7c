"""Stages: what runs a block range for a message and returns the next message.

A ``LocalStage`` wraps a model chunk (the torch ``Transformer``, or a numpy chunk that never meets
torch) with its own KV slot table: the ring's sample ids map to KV rows per node, so a message never
carries slots, and a RELEASE frees a sample's row on every node it passes. ``pipeline`` strings
stages together, with the ring's links as a remote tail."""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Tuple

import numpy as np

from . import messages
from .messages import Message
from .protocol import NodeStatus, busy_fraction
from .slots import SlotTable
from ..base.arrays import BF16_WORDS, float32
from ..base.errors import RingError

if TYPE_CHECKING:
    from ..model.earlyexit.policy import ExitPolicy


_ALREADY = contextlib.nullcontext()
log = logging.getLogger("mdiedge.stage")


def inference() -> ContextManager[Any]:
    """``torch.inference_mode()``, or nothing where it is on already or torch was never imported.
    Entered once per step or around a worker's loop, not per message: with the cache cold after the
    weights, entering costs tens of µs."""
    torch = sys.modules.get("torch")
    if torch is None or torch.is_inference_mode_enabled():
        return _ALREADY
    return torch.inference_mode()


def takes_numpy(model: Any) -> bool:
    """Whether a model chunk runs on numpy arrays (else it is the torch ``Transformer``)."""
    return bool(getattr(model, "takes_numpy", False))


def as_tensor(x: Any, device: Any, dtype: Any = None) -> Any:
    """Numpy through ``torch.from_numpy`` (no copy on the CPU); ``dtype`` None: its own."""
    import torch

    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x).view(torch.bfloat16) if x.dtype == BF16_WORDS \
            else torch.from_numpy(x)
    dtype = x.dtype if dtype is None else dtype
    if x.device != device or x.dtype != dtype:
        x = x.to(device=device, dtype=dtype)
    return x


@dataclass
class StageCounters:
    """Since the KV cache was set up (status and benchmarks)."""

    messages: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    since: float = 0.0  # time.time() of the set-up
    kv_fill_s: float = 0.0  # early exit: filling the KV of the blocks a step skipped


def joined_routes(routes: List[Dict[str, str]]) -> Dict[str, str]:
    """A part is ``step`` only where every stage holding it runs it there; reasons joined."""
    joined: Dict[str, str] = {}
    for route in routes:
        for part in ("blocks", "head"):
            if part in route and joined.get(part, "step") == "step":
                joined[part] = route[part]
    reasons = [r["reason"] for r in routes if r.get("reason")]
    if reasons:
        joined["reason"] = "; ".join(reasons)
    return joined


class LocalStage:
    """Blocks of one in-process model chunk, for ``n_slots`` samples of ``context`` tokens.
    ``trim_prefill``: the last stage before the head returns only a prefill chunk's last position
    (unless ``all_rows``); a verifying decode step returns all. ``exit_policy``: one-position decode
    steps may exit after any block; a step exited upstream only fills KV here."""

    def __init__(self, model: Any, n_slots: int, context: int, trim_prefill: bool = False,
                 exit_policy: Optional[ExitPolicy] = None) -> None:
        self.model = model  # a Transformer, or a chunk that takes numpy
        self.exit_policy = exit_policy
        self.numpy = takes_numpy(model)
        self.device, self.dtype = ("cpu", np.float32) if self.numpy else _placement(model)
        self.trim_prefill = trim_prefill
        self.n_slots, self.context = n_slots, context
        model.setup_cache(n_slots, context)
        self.decode_route = dict(model.decode_route) if self.numpy else _torch_route(model)
        if "reason" in self.decode_route and str(self.device) == "cpu":
            log.warning("decode of blocks [%d, %d) runs in torch, not the compiled step: %s",
                        model.first, model.last, self.decode_route["reason"])
        self.slots = SlotTable(n_slots)
        self.counters = StageCounters(since=time.time())

    @property
    def layers(self) -> List[int]:
        return [self.model.first, self.model.last]

    def forward(self, message: Message) -> Message:
        """RELEASE frees slots, PING and SHUTDOWN pass."""
        t0 = time.perf_counter()
        if message.kind == messages.ACTIVATION:
            out = self._run(message)
            self.counters.tokens += message.tokens
        elif message.kind == messages.RELEASE:
            self.release(message.sample_ids)
            out = message
        else:
            out = message
        self.counters.messages += 1
        self.counters.compute_s += time.perf_counter() - t0
        return out

    def _inputs(self, x: Any, rows: List[int]) -> Tuple[Any, Any]:
        """Float32 and int64 numpy, or torch tensors on the chunk's device."""
        if self.numpy:
            return float32(x), np.array(rows, dtype=np.int64)
        import torch

        return as_tensor(x, self.device, self.dtype), torch.tensor(rows, device=self.device)

    def _run(self, message: Message) -> Message:
        x = message.hidden
        assert x is not None
        self._check(message, x)
        x, slots = self._inputs(x, self._rows(message))
        positions = list(message.positions)
        if self.exit_policy is not None and not message.prefill and x.shape[1] == 1:
            return self._run_exiting(message, x, slots, positions)
        if message.exit_depth:
            raise RingError(f"layers {self.layers}: a step exited after block "
                            f"{message.exit_depth} but early exit is off here")
        with inference():
            y = self.model.run_blocks(x, slots, positions)  # (B, T, dim)
        if self.trim_prefill and message.prefill and not message.all_rows:
            y = y[:, -1:]  # (B, 1, dim)
        return message.reply(y)

    def _run_exiting(self, message: Message, x: Any, slots: Any,
                     positions: List[int]) -> Message:
        """The blocks with the criterion after each, or after an exit (here or before) the KV fill
        of the rest."""
        from ..model.earlyexit.policy import ExitStep

        assert self.exit_policy is not None
        step = ExitStep.start(self.exit_policy, x.shape[0], message.eligible,
                              message.exit_depth)
        with inference():
            if step.exited:
                t0 = time.perf_counter()
                self.model.fill_kv(x, slots, positions)
                self.counters.kv_fill_s += time.perf_counter() - t0
                y = x
            else:
                y = self.model.run_blocks(x, slots, positions, step)  # (B, T, dim)
                self.counters.kv_fill_s += step.fill_s
        out = message.reply(y)
        out.exit_depth, out.eligible = step.depth, step.eligible_list()
        return out

    def _check(self, message: Message, x: Any) -> None:
        """A one-line RingError for an activation that does not fit the samples, width or context: a
        peer's bug or a forged frame."""
        rows, dim, positions = len(message.sample_ids), self.model.cfg.dim, message.positions
        if len(x.shape) != 3 or x.shape[0] != rows or x.shape[2] != dim or len(positions) != rows:
            raise RingError(f"layers {self.layers}: an activation {tuple(x.shape)} with "
                            f"{len(positions)} positions for {rows} samples of width {dim}")
        if rows and (min(positions) < 0 or max(positions) + x.shape[1] > self.context):
            raise RingError(f"layers {self.layers}: positions {min(positions)}.."
                            f"{max(positions) + x.shape[1] - 1} outside the context of "
                            f"{self.context}")

    def _rows(self, message: Message) -> List[int]:
        """KV rows of the message's samples; a prefill at position 0 takes a free row. Each row's
        position must follow its filled length (a RingError otherwise: stale or forged), unless
        marked ``rewind`` (verifying drafts, or after a prompt-cache prefix), which overwrites the
        rows past."""
        slots = self.slots
        assert message.hidden is not None
        try:
            rows = [slots.get_or_allocate(i) if message.prefill and p == 0 else slots.slot_of(i)
                    for i, p in zip(message.sample_ids, message.positions)]
            slots.advance(message.sample_ids, message.positions, message.hidden.shape[1],
                          restart=message.prefill, rewind=message.rewind)
            return rows
        except Exception as e:  # SlotError: unknown sample, every row taken, a stale step
            raise RingError(f"layers {self.layers}: {e}") from None

    def release(self, sample_ids: List[int]) -> None:
        held = self.slots.assignments()
        for i in sample_ids:
            if i in held:
                self.slots.free(i)

    def clear(self) -> None:
        """Forget every sample (a new ring, or the old one ended)."""
        self.slots.clear()

    @property
    def slots_in_use(self) -> int:
        return int(self.slots.in_use)

    def describe(self, status: NodeStatus, scheduler: Optional[Any] = None) -> None:
        """Fill ``status`` with this stage's blocks, route, memory, expert load, slots, messages,
        tokens and busy share; a starter's ``scheduler`` counts for its whole process."""
        counters = self.counters
        stats = scheduler.stats if scheduler is not None else counters
        memory = self.memory()
        status.layers, status.decode = self.layers, dict(self.decode_route)
        status.weight_bytes, status.kv_bytes = memory["weight_bytes"], memory["kv_bytes"]
        status.expert_load = self.model.expert_load()
        status.slots_in_use = scheduler.slots_in_use if scheduler is not None \
            else self.slots_in_use
        status.messages, status.tokens = stats.messages, stats.tokens
        status.compute_s, status.kv_fill_s = round(stats.compute_s, 6), round(counters.kv_fill_s, 6)
        status.busy_fraction = busy_fraction(stats.compute_s, time.time() - counters.since)

    def memory(self) -> Dict[str, int]:
        return {"weight_bytes": self.model.parameter_bytes(),
                "kv_bytes": self.model.kv_cache_bytes()}


def _placement(model: Any) -> Tuple[Any, Any]:
    """Its first parameter's device and dtype (CPU float32 without parameters)."""
    import torch

    param = next(model.parameters(), None)
    return (param.device, param.dtype) if param is not None else \
        (torch.device("cpu"), torch.float32)


def _torch_route(model: Any) -> Dict[str, str]:
    from ..model.transformer import route_of

    return route_of(model)
