"""The engine with every block in this process: ``--nodes 1``, or several in-process stages in
a ring's proportions (tests and the quality guard compare those with a real ring)."""
from __future__ import annotations

import threading
from typing import Any, List, Optional, Sequence

from ..base.accel import running_code
from ..base.threads import compute_threads
from ..model.chunks import open_chunk
from ..model.modelfile import reads
from ..placement.partition import split_layers
from ..roles.devices import device_of
from ..roles.earlyexit import starter_policy
from ..runtime.compute import ComputeThread
from ..runtime.pipeline import EmbedAndHead, Pipeline
from ..runtime.plan import layout_for
from ..runtime.scheduler import Scheduler
from ..runtime.stages import LocalStage, joined_routes
from ..runtime.protocol import NodeStatus
from .engine import Engine, PathLike, TextModel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..model.earlyexit.files import ExitSettings


class LocalEngine(Engine):
    """Every block in this process, split over ``stages`` in-process stages in the ring's
    proportions (one stage: the plain single-process engine)."""

    def __init__(self, model: Optional[PathLike] = None, tokenizer: Optional[PathLike] = None,
                 device: str = "cpu", dtype: str = "float32", stages: int = 1,
                 prefill_chunk: int = 0, early_exit: Optional[ExitSettings] = None,
                 quantize: str = "", text: Optional[TextModel] = None,
                 torch_for: Optional[str] = None) -> None:
        self._open(model, tokenizer, text)
        self.early_exit = early_exit
        self.torch_for = torch_for or (None if early_exit is None else "--early-exit")
        self.device, self.dtype = device_of(device), dtype
        self.ranges = split_layers(self.cfg.n_layers, [1.0] * stages) if stages > 1 \
            else [(0, self.cfg.n_layers)]
        self.compute = ComputeThread()  # loads, sets up and steps: all torch work here
        self.chunks = self.compute.call(self._load, quantize)
        self.model = self.chunks[0]  # the embedding, the first blocks and the head
        self.exit_policy = None if early_exit is None else self.compute.call(
            starter_policy, early_exit, self.file.content_hash(), self.model)
        self.prefill_chunk = prefill_chunk
        self.scheduler: Optional[Scheduler] = None
        self._setup_lock = threading.Lock()

    def _load(self, quantize: str) -> List[Any]:
        """Each stage's chunk of the model (on the compute thread)."""
        return [open_chunk(self.path, r, i == 0, i == 0, self.device, self.dtype,
                           quantize or None, self.torch_for)
                for i, r in enumerate(self.ranges)]

    def prepare(self, n_slots: int, context: int) -> Scheduler:
        current = self.scheduler
        layout = layout_for(None if current is None else current.pipeline.layout,
                            current is not None and current.usable,
                            current is None or current.idle, (n_slots, context),
                            "this process's pipeline")
        if layout is not None:
            self.scheduler = self.compute.call(self._set_up, *layout)
        assert self.scheduler is not None
        return self.scheduler

    def _set_up(self, n_slots: int, context: int) -> Scheduler:
        """A scheduler over new stages of ``n_slots`` x ``context`` KV rows (on the compute
        thread, which steps it)."""
        last = len(self.chunks) - 1
        stages = [LocalStage(chunk, n_slots, context, trim_prefill=i == last,
                             exit_policy=self.exit_policy)
                  for i, chunk in enumerate(self.chunks)]
        return Scheduler(Pipeline(stages), EmbedAndHead(self.model), self.prefill_chunk,
                         exit_layers=self.cfg.n_layers if self.exit_policy is not None else 0,
                         compute=self.compute)

    @property
    def stages(self) -> Sequence[LocalStage]:
        return self.scheduler.pipeline.stages if self.scheduler is not None else []

    def status(self) -> List[NodeStatus]:
        """This process as the one node: its blocks, its share of time computing and the KV
        slots its requests hold."""
        scheduler = self.scheduler
        status = NodeStatus("starter", "local", "ready" if scheduler is None or scheduler.idle
                            else "busy", threads=compute_threads(), code=running_code(),
                            file_reads=reads(), layers=[0, self.cfg.n_layers])
        stages = self.stages
        if scheduler is not None and stages:
            stages[0].describe(status, scheduler)  # then the whole process's blocks:
            status.layers = [0, self.cfg.n_layers]
            status.decode = joined_routes([s.decode_route for s in stages])
            status.weight_bytes = sum(s.memory()["weight_bytes"] for s in stages)
            status.kv_bytes = sum(s.memory()["kv_bytes"] for s in stages)
            status.kv_fill_s = round(self.kv_fill_s(), 6)
            status.expert_load = {k: v for s in stages for k, v in s.model.expert_load().items()}
        return [status]

    def kv_fill_s(self) -> float:
        return sum(stage.counters.kv_fill_s for stage in self.stages)
