"""Stages: what runs a block range for a message and returns the next message.

A ``LocalStage`` wraps a ``Transformer`` chunk (blocks ``[first, last)`` of the same model code
that runs single-process) with its own KV slot table: the ring's sample ids map to KV rows per
node, so a message never carries slots, and a RELEASE frees a sample's row on every node it
passes. The starter's chunk, each worker's chunk and every in-process pipeline stage are
``LocalStage``s; ``mdiedge.runtime.pipeline`` strings them together, with the ring's links as
a remote tail.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from . import messages
from .messages import Message
from .slots import SlotTable
from ..base.errors import RingError


@dataclass
class StageCounters:
    """What a stage has done since its KV cache was set up (status and benchmarks)."""

    messages: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    since: float = 0.0  # time.time() of the set-up


class LocalStage:
    """Blocks of one in-process model chunk, for ``n_slots`` samples of ``context`` tokens.

    ``trim_prefill``: the last stage before the head returns only the last position of a
    prefill chunk (the head needs no more)."""

    def __init__(self, model: Any, n_slots: int, context: int, trim_prefill: bool = False) -> None:
        self.model = model  # a mdiedge.model.transformer.Transformer
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32
        self.trim_prefill = trim_prefill
        self.n_slots, self.context = n_slots, context
        model.setup_cache(n_slots, context)
        self.slots = SlotTable(n_slots)
        self.counters = StageCounters(since=time.time())

    @property
    def layers(self) -> List[int]:
        return [self.model.first, self.model.last]

    def forward(self, message: Message) -> Message:
        """Run ``message`` through this stage; RELEASE frees slots, PING and SHUTDOWN pass."""
        t0 = time.perf_counter()
        if message.kind == messages.ACTIVATION:
            out = message.reply(self._run(message))
            self.counters.tokens += message.tokens
        elif message.kind == messages.RELEASE:
            self.release(message.sample_ids)
            out = message
        else:
            out = message
        self.counters.messages += 1
        self.counters.compute_s += time.perf_counter() - t0
        return out

    def _run(self, message: Message) -> torch.Tensor:
        rows = self._rows(message)
        x = message.hidden
        assert x is not None
        with torch.inference_mode():
            y = self.model.run_blocks(x.to(device=self.device, dtype=self.dtype),
                                      torch.tensor(rows, device=self.device),
                                      list(message.positions))  # (B, T, dim)
        if self.trim_prefill and message.prefill:
            y = y[:, -1:]  # (B, 1, dim)
        return y

    def _rows(self, message: Message) -> List[int]:
        """KV rows of the message's samples: a prefill at position 0 takes a free row."""
        slots = self.slots
        try:
            return [slots.get_or_allocate(i) if message.prefill and p == 0 else slots.slot_of(i)
                    for i, p in zip(message.sample_ids, message.positions)]
        except Exception as e:  # SlotError: unknown sample or every row taken
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

    def memory(self) -> Dict[str, int]:
        return {"weight_bytes": self.model.parameter_bytes(),
                "kv_bytes": self.model.kv_cache_bytes()}
