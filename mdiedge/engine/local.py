"""The engine with every block in this process: ``--nodes 1``, or several in-process stages in
a ring's proportions (tests and the quality guard compare those with a real ring)."""
from __future__ import annotations

import threading
import time
from typing import List, Optional, Sequence

from ..model.checkpoint import content_hash, load_model
from ..model.devices import parse_device, parse_dtype
from ..model.exitfiles import ExitSettings
from ..placement.partition import split_layers
from ..roles.exitparts import starter_policy
from ..runtime.pipeline import ModelEnds, Pipeline
from ..runtime.scheduler import Scheduler
from ..runtime.stages import LocalStage
from ..runtime.protocol import NodeStatus, busy_fraction
from .facade import Engine, PathLike, TextModel


class LocalEngine(Engine):
    """Every block in this process, split over ``stages`` in-process stages in the ring's
    proportions (one stage: the plain single-process engine)."""

    def __init__(self, model: Optional[PathLike] = None, tokenizer: Optional[PathLike] = None,
                 device: str = "cpu", dtype: str = "float32", stages: int = 1,
                 prefill_chunk: int = 0, early_exit: Optional[ExitSettings] = None,
                 quantize: str = "", text: Optional[TextModel] = None) -> None:
        self._open(model, tokenizer, text)
        self.early_exit = early_exit
        self.device, self.dtype = str(parse_device(device)), parse_dtype(dtype)
        self.ranges = split_layers(self.cfg.n_layers, [1.0] * stages) if stages > 1 \
            else [(0, self.cfg.n_layers)]
        self.chunks = [load_model(self.path, layers=r, embedding=i == 0, head=i == 0,
                                  device=self.device, dtype=self.dtype,
                                  quantize=quantize or None)
                       for i, r in enumerate(self.ranges)]
        self.model = self.chunks[0]  # the embedding, the first blocks and the head
        self.exit_policy = starter_policy(early_exit, content_hash(self.path), self.model)
        self.prefill_chunk = prefill_chunk
        self.scheduler: Optional[Scheduler] = None
        self._setup_lock = threading.Lock()

    def prepare(self, n_slots: int, context: int) -> Scheduler:
        current = self.scheduler
        if current is not None and (not current.usable or current.idle and (
                current.pipeline.n_slots < n_slots or current.pipeline.context < context)):
            current = None  # broken, or too small with nothing running: set up anew
        if current is None:
            last = len(self.chunks) - 1
            stages = [LocalStage(chunk, n_slots, context, trim_prefill=i == last,
                                 exit_policy=self.exit_policy)
                      for i, chunk in enumerate(self.chunks)]
            current = self.scheduler = Scheduler(
                Pipeline(stages), ModelEnds(self.model), self.prefill_chunk,
                exit_layers=self.cfg.n_layers if self.exit_policy is not None else 0)
        return current

    @property
    def stages(self) -> Sequence[LocalStage]:
        return self.scheduler.pipeline.stages if self.scheduler is not None else []

    def status(self) -> List[NodeStatus]:
        """This process as the one node: its blocks, its share of time computing and the KV
        slots its requests hold."""
        scheduler = self.scheduler
        busy = 0.0 if scheduler is None else busy_fraction(
            scheduler.stats.compute_s, time.time() - scheduler.pipeline.stages[0].counters.since)
        idle = scheduler is None or scheduler.idle
        return [NodeStatus("starter", "local", "ready" if idle else "busy",
                           layers=[0, self.cfg.n_layers], busy_fraction=busy,
                           slots_in_use=scheduler.slots_in_use if scheduler is not None else 0)]

    def kv_fill_s(self) -> float:
        return sum(stage.counters.kv_fill_s for stage in self.stages)
