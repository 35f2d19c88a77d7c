"""The one scheduler: it alone decides what runs next on a pipeline of stages.

It admits requests into free KV slots (continuous batching: a new request's prefill enters
between the steps of the ones decoding), groups each request's samples into micro-batches,
cuts prompts into frame-sized prefill chunks, sends each group's next decode step as soon as
its previous one comes back (recurrent pipeline parallelism: with as many groups in flight as
nodes, every node is busy; MDI-LLM, Macario et al. 2024), merges the decode steps of
different requests into shared messages once that many are in flight (``DecodeMerger``), and
frees a finished sample's KV rows on every node with one RELEASE.

One thread steps at a time; any number may ``run`` a request at once, each stepping until its
own request is done, so token callbacks run on whichever thread stepped.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import messages
from .generation import ExitCounts, Generation, Recovery, Sample, Timing
from .messages import Message
from .pipeline import ModelEnds, Pipeline
from .slots import MAX_SAMPLE_ID
from .stages import LocalStage, inference
from ..base import defaults
from ..base.errors import GenerationError, MdiedgeError, NodeLost, QueueFull, RingError

_ID_SPACE = MAX_SAMPLE_ID  # sample ids and seqs are u32 on the wire; 0 is never used
MAX_RECOVERY_ATTEMPTS = 8  # set-ups tried in a row after a loss (each may lose another node)
MAX_FRUITLESS_RECOVERIES = 3  # recoveries in a row with no token sampled between them
MAX_RECOVERIES_PER_REQUEST = 8  # a loss that keeps coming back fails the request

# Given the loss, a pipeline without the lost nodes and its model ends (or an error saying
# why there is none): the starter's ``RingStarter.rebuild``.
Rebuild = Callable[[NodeLost], Tuple[Pipeline, ModelEnds]]


def group_size(n_samples: int, micro_batch: int, nodes: int, max_rows: int = 0) -> int:
    """Samples per decode message: ``micro_batch`` if given, else enough groups to keep
    every node busy; never more rows than one frame may carry (``max_rows``, 0: no limit)."""
    size = micro_batch if micro_batch > 0 else max(1, math.ceil(n_samples / max(1, nodes)))
    return max(1, min(size, max_rows)) if max_rows > 0 else size


def prefill_chunks(prompt_len: int, chunk: int) -> List[Tuple[int, int]]:
    """``[start, end)`` of each prefill message of a prompt (``chunk`` 0: one message)."""
    step = chunk if chunk > 0 else max(1, prompt_len)
    return [(start, min(start + step, prompt_len)) for start in range(0, prompt_len, step)]


def prefill_rows(chunk: int, max_payload: int, row_bytes: int) -> int:
    """Prompt tokens per prefill message of a ring: ``chunk`` (0: the whole prompt), never
    more than a frame of ``max_payload`` bytes holds at ``row_bytes`` a token (at least 1)."""
    rows = max(1, max_payload // max(1, row_bytes))
    return min(rows, chunk) if chunk > 0 else rows


@dataclass(eq=False)
class _Group:
    """Samples of one request that travel in one decode message."""

    generation: Generation
    samples: List[Sample]
    prefilled: int = 0  # members whose prefill came back
    fixed: bool = False  # sized by an explicit micro-batch: its decode steps travel alone


@dataclass(eq=False)
class _InFlight:
    kind: str  # "prefill", "decode" or "release"
    group: Optional[_Group] = None
    samples: List[Sample] = field(default_factory=list)
    final: bool = True  # the last chunk of a prefill
    replay: Optional[Recovery] = None  # the recovery this prefill replays for
    parts: List[Tuple[_Group, List[Sample]]] = field(default_factory=list)  # a merged decode


Part = Tuple[_Group, List[Sample]]


class DecodeMerger:
    """Decode steps that travel together across requests (continuous batching: sixteen
    one-sample requests decode in a few messages, not sixteen). A group's next step waits
    here while ``limit`` merged messages are in flight (as many as nodes keep every node
    busy), then leaves with every other one waiting, up to ``max_rows`` rows a message."""

    def __init__(self) -> None:
        self.parts: List[Part] = []
        self.in_flight = 0

    def add(self, part: Part) -> None:
        self.parts.append(part)

    def take(self, limit: int, max_rows: int = 0) -> List[Part]:
        """The parts of the next merged message (counted in flight), or [] when none waits
        or ``limit`` are in flight already. ``max_rows`` 0: no limit."""
        if not self.parts or self.in_flight >= limit:
            return []
        taken = [self.parts.pop(0)]
        rows = len(taken[0][1])
        while self.parts and (max_rows <= 0 or rows + len(self.parts[0][1]) <= max_rows):
            rows += len(self.parts[0][1])
            taken.append(self.parts.pop(0))
        self.in_flight += 1
        return taken

    def returned(self) -> None:
        self.in_flight -= 1

    def clear(self) -> None:
        self.parts, self.in_flight = [], 0


def fail_generation(generation: Generation, error: Exception) -> None:
    """One request failed on its own: it ends with ``error``, its rows are freed as its
    messages come back, and the other requests go on."""
    if generation.error is None:
        generation.error = error if isinstance(error, MdiedgeError) else \
            GenerationError(f"{type(error).__name__}: {error}")
    generation.cancel_requested = True
    for sample in generation.samples:
        if not sample.done:
            sample.finish_reason = "error"


class Waiting:
    """Requests not yet admitted, first come first served: any thread adds (up to ``limit``),
    the stepping thread takes them in order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: Deque[Tuple[Generation, int]] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Tuple[Generation, int],
            broken: Callable[[], Optional[BaseException]]) -> None:
        """Queue ``item`` unless the pipeline broke (checked under the lock ``take_all``
        holds, so nothing is queued after a failure drained the queue) or the queue is full."""
        with self._lock:
            error = broken()
            if error is not None:
                raise RingError(f"the pipeline failed before: {error}")
            if len(self._items) >= self.limit:
                raise QueueFull(f"{len(self._items)} requests are waiting already")
            self._items.append(item)

    def first(self) -> Optional[Tuple[Generation, int]]:
        with self._lock:
            return self._items[0] if self._items else None

    def pop(self) -> None:
        with self._lock:
            self._items.popleft()

    def take_all(self) -> List[Tuple[Generation, int]]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            return items


@dataclass
class SchedulerStats:
    messages: int = 0
    tokens: int = 0
    compute_s: float = 0.0  # embedding, local stages and head, on this process
    wall_s: float = 0.0  # time with something in flight


def accept_parts(ends: ModelEnds, parts: List[Part], hidden: Any) -> None:
    """Each request's next tokens from its rows of ``hidden`` (B, T, dim), in order; a
    failure (sampling, a token callback) is that request's own."""
    try:
        logits = ends.head(hidden[:, -1])  # (B, vocab)
    except Exception as e:
        for group, _ in parts:
            fail_generation(group.generation, e)
        return
    row = 0
    for group, samples in parts:
        try:
            group.generation.accept(samples, logits[row:row + len(samples)])
        except Exception as e:
            fail_generation(group.generation, e)
        row += len(samples)


def note_prefill_done(groups: List[_Group], generation: Generation) -> None:
    """The request's prefill is done once every one of its groups came back."""
    if all(g.prefilled == len(g.samples) for g in groups if g.generation is generation):
        generation.mark_prefilled()


def count_exits(parts: List[Part], depth: int, n_layers: int) -> None:
    """Each request's decode rows of a message that came back after ``depth`` blocks (0:
    every block)."""
    for group, samples in parts:
        generation = group.generation
        if generation.exits is None:
            generation.exits = ExitCounts(n_layers)
        generation.exits.add(depth, len(samples))


def settle(group: _Group) -> Tuple[Optional[_Group], int]:
    """``group`` as a rebuilt pipeline sees it: its samples that go on (None if none), and how
    many that ended (finished, failed, cancelled) it frees here: the new pipeline never held
    rows for them, so no RELEASE goes round."""
    generation = group.generation
    if generation.cancel_requested:
        for sample in group.samples:
            if not sample.done:
                sample.finish_reason = "cancelled"
    ended = [s for s in group.samples if s.done and not s.released]
    for sample in ended:
        sample.released = True
    if ended and all(s.done for s in generation.samples):
        generation.finish()
    active = [s for s in group.samples if not s.done]
    return (_Group(generation, active, fixed=group.fixed) if active else None), len(ended)


class Scheduler:
    """Runs generations over ``pipeline`` with ``ends`` (embedding and head).

    ``prefill_chunk``: tokens per prefill message (0: the whole prompt); ``max_rows``: samples
    per decode message at most (0: ``prefill_chunk``); ``timeout_s``: how long a message may
    take around the pipeline; ``rebuild``: when nodes are lost, gives the pipeline without
    them, and every live sample's tokens so far are replayed through it as a
    prefill (Petals-style recovery; its sampling generator carries on, so the output is the
    one it would have been, except under early exit: a replay computes every block where the
    exits had filled KV); ``exit_layers``: the model's blocks, when decode steps may exit
    early (their exits are counted per request)."""

    def __init__(self, pipeline: Pipeline, ends: ModelEnds, prefill_chunk: int = 0,
                 timeout_s: Optional[float] = None, max_waiting: int = defaults.MAX_QUEUE, max_rows: int = 0,
                 rebuild: Optional[Rebuild] = None, exit_layers: int = 0) -> None:
        self.pipeline, self.ends, self.rebuild = pipeline, ends, rebuild
        self.exit_layers, self.max_rows = exit_layers, max_rows or prefill_chunk
        self.recoveries: List[Recovery] = []
        self._progress = time.perf_counter()  # when a message last came back
        self._fruitless = 0  # recoveries since a token was last sampled
        self.prefill_chunk, self.timeout_s, self.max_waiting = prefill_chunk, timeout_s, max_waiting
        self.stats = SchedulerStats()
        self._waiting = Waiting(max_waiting)
        self._driver = threading.Lock()  # held by the thread that steps
        self._inflight: Dict[int, _InFlight] = {}
        self._groups: List[_Group] = []  # live groups, to fail or cancel
        self._merger = DecodeMerger()
        self._live = 0  # samples holding KV rows
        self._next_id = self._seq = 0
        self.broken: Optional[BaseException] = None  # set when a step failed

    # ----------------------------------------------------------------- requests

    @property
    def usable(self) -> bool:
        return self.broken is None

    @property
    def idle(self) -> bool:
        """No request admitted or waiting (a RELEASE may still be on its way round)."""
        return self._live == 0 and len(self._waiting) == 0

    @property
    def slots_in_use(self) -> int:
        return self._live

    def submit(self, generation: Generation, micro_batch: int = 0) -> None:
        """Queue ``generation``; it is admitted when its samples fit the free KV slots."""
        n, slots = len(generation.samples), self.pipeline.n_slots
        if n > slots:
            raise GenerationError(f"{n} samples exceed the {slots} KV slots of this pipeline")
        if generation.context > self.pipeline.context:
            raise GenerationError(f"prompt plus budget of {generation.context} tokens exceeds "
                                  f"the {self.pipeline.context} set up on this pipeline")
        self._waiting.add((generation, micro_batch), lambda: self.broken)

    def run(self, generation: Generation, micro_batch: int = 0) -> Timing:
        """Submit ``generation`` and step until it is done; its timing, or its error."""
        self.submit(generation, micro_batch)
        return self.wait(generation)

    def wait(self, generation: Generation) -> Timing:
        """Step until the submitted ``generation`` is done (and, when it failed on its own,
        until its rows are freed); its timing, or its error."""
        def pending() -> bool:
            return not generation.finished or (self.usable and not generation.settled)

        while pending():
            with self._driver:
                if pending():
                    self.step()
        if generation.error is not None:
            raise generation.error
        return generation.timing

    def drain(self) -> None:
        """Step until nothing is in flight (releases included)."""
        with self._driver:
            while self._inflight:
                self.step()

    # ----------------------------------------------------------------- one step

    def step(self) -> None:
        """Admit what fits, then take one message back and act on it (the caller holds the
        driver lock, as ``run`` does)."""
        started = time.perf_counter()
        try:
            with inference():  # once for the step's stages and ends (recovery runs outside)
                self._admit()
                if not self._inflight:
                    if len(self._waiting):  # nothing runs that could free the rows it waits for
                        raise RingError(f"{self._live} KV rows are held with nothing in flight")
                    return
                message = self.pipeline.receive(self.timeout_s)
                self._progress = time.perf_counter()
                entry = self._inflight.pop(message.seq, None)
                if entry is None:
                    raise RingError(f"the ring returned an unknown message (seq {message.seq})")
                self._complete(entry, message)
            self.stats.wall_s += time.perf_counter() - started  # time with work in flight
        except NodeLost as e:
            try:
                error: Optional[BaseException] = self._recover(e)
            except BaseException as inner:  # e.g. out of memory loading the moved layers
                error = inner
            if error is not None:
                self.broken = error
                self._fail_all(error if isinstance(error, MdiedgeError)
                               else RingError(f"interrupted while recovering: {error!r}"))
                raise error from None
        except BaseException as e:  # the pipeline's state is unknown now: it cannot be reused
            self.broken = e
            self._fail_all(e if isinstance(e, MdiedgeError) else RingError(f"interrupted: {e!r}"))
            raise

    def _admit(self) -> None:
        while True:
            head = self._waiting.first()
            if head is None:
                return
            generation, micro_batch = head
            if generation.cancel_requested:
                self._waiting.pop()
                for sample in generation.samples:
                    sample.finish_reason, sample.released = "cancelled", True
                generation.finish()
                continue
            if self._live + len(generation.samples) > self.pipeline.n_slots:
                return  # first come, first served: later requests wait behind it
            self._live += len(generation.samples)  # before it leaves the queue: never idle between
            self._waiting.pop()
            self._start(generation, micro_batch)

    def _start(self, generation: Generation, micro_batch: int) -> None:
        samples = generation.samples
        for sample in samples:
            sample.sid = self._new_id()
        generation.mark_admitted()
        size = group_size(len(samples), micro_batch, self.pipeline.nodes, self.max_rows)
        groups = [_Group(generation, samples[i:i + size], fixed=micro_batch > 0)
                  for i in range(0, len(samples), size)]
        self._groups.extend(groups)
        for i, sample in enumerate(samples):
            group = groups[i // size]
            for start, end in prefill_chunks(len(sample.prompt), self.prefill_chunk):
                self._send(messages.ACTIVATION, [sample], [sample.prompt[start:end]], [start],
                           _InFlight("prefill", group, [sample], final=end == len(sample.prompt)),
                           prefill=True)

    def _new_id(self) -> int:
        self._next_id = self._next_id % (_ID_SPACE - 1) + 1
        return self._next_id

    # ----------------------------------------------------------------- results

    def _complete(self, entry: _InFlight, message: Message) -> None:
        if entry.replay is not None:
            entry.replay.pending -= 1
            if entry.replay.pending == 0:
                entry.replay.recover_s = time.perf_counter() - entry.replay.started
        if entry.kind == "release" or not entry.final:
            return
        assert message.hidden is not None
        t0 = time.perf_counter()
        self._fruitless = 0
        parts = entry.parts or [(entry.group, entry.samples)]
        if self.exit_layers and entry.kind == "decode":
            count_exits(parts, message.exit_depth, self.exit_layers)
        accept_parts(self.ends, parts, message.hidden)
        self.stats.compute_s += time.perf_counter() - t0  # sends count their own time
        if entry.parts:
            self._merger.returned()
        for group, _ in parts:
            if entry.kind == "prefill":
                group.prefilled += 1
                if group.prefilled < len(group.samples):
                    continue
                note_prefill_done(self._groups, group.generation)
            self._next_step(group)
        while True:
            merged = self._merger.take(self.pipeline.nodes, self.max_rows)
            if not merged:
                return
            rows = [s for _, samples in merged for s in samples]
            self._send(messages.ACTIVATION, rows, [[s.tokens[-1]] for s in rows],
                       [s.position for s in rows], _InFlight("decode", parts=merged))

    def _next_step(self, group: _Group) -> None:
        """After a group's step came back: free what finished, then its next decode step
        (alone when its micro-batch was given, else merged with other requests')."""
        self._release_finished(group)
        batch = [s for s in group.samples if not s.done]
        if not batch:
            self._groups.remove(group)
        elif group.fixed:
            self._send(messages.ACTIVATION, batch, [[s.tokens[-1]] for s in batch],
                       [s.position for s in batch], _InFlight("decode", group, batch))
        else:
            self._merger.add((group, batch))

    def _release_finished(self, group: _Group) -> None:
        if group.generation.cancel_requested:
            for sample in group.samples:
                if not sample.done:
                    sample.finish_reason = "cancelled"
        done = [s for s in group.samples if s.done and not s.released]
        if not done:
            return
        for sample in done:
            sample.released = True
        self._live -= len(done)
        self._send(messages.RELEASE, done, None, [0] * len(done), _InFlight("release"))
        if all(s.done for s in group.generation.samples):
            group.generation.finish()

    # ----------------------------------------------------------------- sending

    def _send(self, kind: int, samples: List[Sample], tokens: Optional[List[List[int]]],
              positions: List[int], entry: _InFlight, prefill: bool = False) -> None:
        t0 = time.perf_counter()
        hidden = self.ends.embed(tokens) if tokens is not None else None  # (B, T, dim)
        if not self._inflight:  # a loss is timed from here when nothing was running
            self._progress = time.perf_counter()
        self._seq = self._seq % _ID_SPACE + 1
        message = Message(kind, [s.sid for s in samples], list(positions), hidden, prefill,
                          self._seq)
        self._inflight[self._seq] = entry
        self.pipeline.submit(message)
        self.stats.messages += 1
        self.stats.tokens += message.tokens
        self.stats.compute_s += time.perf_counter() - t0

    # ----------------------------------------------------------------- recovery

    def _recover(self, lost: NodeLost) -> Optional[MdiedgeError]:
        """Carry on without the ``lost`` nodes: a rebuilt pipeline (set-ups are retried while
        each loses another node), then every live sample replayed. None when it goes on, else
        the error every request fails with."""
        if self.rebuild is None:
            return lost
        self._fruitless += 1
        if self._fruitless > MAX_FRUITLESS_RECOVERIES:
            return RingError(f"gave up: {MAX_FRUITLESS_RECOVERIES} recoveries in a row sampled "
                             f"no token; last: {lost}")
        if any(len(g.generation.recoveries) >= MAX_RECOVERIES_PER_REQUEST for g in self._groups):
            return RingError(f"gave up: a request lived through {MAX_RECOVERIES_PER_REQUEST} "
                             f"recoveries; last: {lost}")
        started = time.perf_counter()
        record = Recovery(list(lost.nodes), max((len(s.tokens) for g in self._groups
                                                 for s in g.samples), default=0),
                          started - self._progress, started=started)
        for _ in range(MAX_RECOVERY_ATTEMPTS):
            try:
                self.pipeline, self.ends = self.rebuild(lost)
                self._inflight, record.pending, record.tokens_replayed = {}, 0, 0
                self._merger.clear()
                self._replay(record)
                break
            except NodeLost as again:  # another node went during the set-up
                lost = again
                record.nodes += [n for n in again.nodes if n not in record.nodes]
            except MdiedgeError as e:
                return RingError(f"lost {', '.join(record.nodes)} and cannot recover: {e}")
        else:
            return RingError(f"lost {', '.join(record.nodes)}; gave up after "
                             f"{MAX_RECOVERY_ATTEMPTS} set-ups: {lost}")
        self.recoveries.append(record)
        for generation in {id(g.generation): g.generation for g in self._groups}.values():
            generation.recoveries.append(record)
        return None

    def _replay(self, record: Recovery) -> None:
        """Each live sample's prompt and tokens so far, as a prefill through the rebuilt
        pipeline: its KV rows are refilled and its last result gives its next token, as the
        decode step that was lost would have. Every group is settled before the first send,
        so a loss during the replay finds them all to replay again."""
        settled = [settle(group) for group in self._groups]
        self._live -= sum(freed for _, freed in settled)
        self._groups = [group for group, _ in settled if group is not None]
        for group in self._groups:
            for sample in group.samples:
                tokens = sample.prompt + sample.tokens
                record.tokens_replayed += len(tokens)
                for start, end in prefill_chunks(len(tokens), self.prefill_chunk):
                    record.pending += 1
                    self._send(messages.ACTIVATION, [sample], [tokens[start:end]], [start],
                               _InFlight("prefill", group, [sample], end == len(tokens), record),
                               prefill=True)
        if record.pending == 0:
            record.recover_s = time.perf_counter() - record.started

    def _fail_all(self, error: BaseException) -> None:
        """The pipeline broke: every admitted and waiting request fails with ``error``."""
        failed = {id(g.generation): g.generation for g in self._groups}
        failed.update((id(g), g) for g, _ in self._waiting.take_all())
        for generation in failed.values():
            generation.error = error
        self._groups, self._inflight, self._live = [], {}, 0
        self._merger.clear()


def run_single(model: Any, generation: Generation, micro_batch: int = 0) -> Timing:
    """Run ``generation`` on one in-process model chunk that holds every block, the embedding
    and the head (a pipeline of one stage): tests and benchmarks of the model itself."""
    stage = LocalStage(model, len(generation.samples), generation.context, trim_prefill=True)
    return Scheduler(Pipeline([stage]), ModelEnds(model)).run(generation, micro_batch)
