"""The one scheduler: it alone decides what runs next on a pipeline of stages.

Continuous batching, micro-batches, frame-sized prefill chunks, each group's next decode step sent
as soon as its previous one is back (recurrent pipeline parallelism, MDI-LLM, Macario et al. 2024),
decode steps of different requests merged into shared messages, and a finished sample's KV rows
freed on every node with one RELEASE. ``plan`` decides (pure functions of the state); the
scheduler's one loop thread carries the plans out, samples every token and runs every token
callback; a request's thread only waits."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from . import messages, plan
from .compute import ComputeThread
from ..base.request import check_context
from .generation import ExitCounts, Generation, Recovery, Sample, Timing
from .messages import Message
from .pipeline import EmbedAndHead, Pipeline
from .plan import (MAX_FRUITLESS_RECOVERIES, Decode, DecodeRows, QueueView, Release,
                   ReturnedGroup, ReturnedSample, Waiter, group_size, prefill_chunks,
                   prefill_rows)
from .promptcache import PromptCache, SampleIds
from .slots import MAX_SAMPLE_ID
from .speculation import Draft, RowCost, plan_step, step_rows
from .stages import LocalStage, inference
from .steploop import StepLoop, Waiting
from ..base import defaults
from ..base.errors import GenerationError, MdiedgeError, NodeLost, RingError

__all__ = ["MAX_FRUITLESS_RECOVERIES", "Scheduler", "group_size", "prefill_chunks",
           "prefill_rows", "run_single"]

_ID_SPACE = MAX_SAMPLE_ID  # sample ids and seqs are u32 on the wire; 0 is never used
MAX_RECOVERY_ATTEMPTS = 8  # set-ups tried in a row after a loss (each may lose another node)

# Given the loss, a pipeline without the lost nodes and its model ends (or an error saying
# why there is none): the starter's ``RingStarter.rebuild``.
Rebuild = Callable[[NodeLost], Tuple[Pipeline, EmbedAndHead]]


@dataclass(eq=False)
class _Group:
    """Samples of one request that travel in one decode message."""

    key: int
    generation: Generation
    samples: List[Sample]
    prefilled: int = 0  # members whose prefill came back
    fixed: bool = False  # sized by an explicit micro-batch: its decode steps travel alone

    def rows(self, sids: Sequence[int]) -> List[Sample]:
        wanted = set(sids)
        return [s for s in self.samples if s.sid in wanted]

    def back(self, width: int = 1) -> ReturnedGroup:
        return ReturnedGroup(self.key, tuple(ReturnedSample(s.sid, s.done, s.released)
                                             for s in self.samples), self.fixed, width)


Rows = Tuple[_Group, List[Sample]]  # a group and its samples in one message


@dataclass(eq=False)
class _InFlight:
    kind: str  # "prefill", "decode" or "release"
    parts: List[Rows] = field(default_factory=list)
    final: bool = True  # the last chunk of a prefill
    replay: Optional[Recovery] = None  # the recovery this prefill replays for
    merged: bool = False  # a decode message that counts against the merged limit
    drafts: Dict[int, Draft] = field(default_factory=dict)  # speculating rows by sample id
    sent: float = 0.0  # a decode message sent alone: when (0: timed with others in flight)
    scored_from: int = -1  # a prefill sent back whole from this position: the head scores it


@dataclass
class SchedulerStats:
    messages: int = 0
    tokens: int = 0
    compute_s: float = 0.0  # embedding, local stages and head, on this process


def accept_parts(ends: EmbedAndHead, parts: List[Rows], hidden: Any,
                 drafts: Optional[Dict[int, Draft]] = None) -> None:
    """Each request's next tokens from its rows of ``hidden`` (B, T, dim); a failure (sampling, a
    callback) is that request's own. ``drafts``: verified drafted tokens by sample id."""
    try:
        if drafts:
            b, t = hidden.shape[:2]
            logits = ends.head(hidden.reshape(b * t, -1)).reshape(b, t, -1)  # (B, T, vocab)
        else:
            logits = ends.head(hidden[:, -1])  # (B, vocab)
    except Exception as e:
        for group, _ in parts:
            group.generation.fail(e)
        return
    row = 0
    for group, samples in parts:
        try:
            rows = logits[row:row + len(samples)]
            if drafts:
                group.generation.settle(samples, rows, drafts)
            else:
                group.generation.accept(samples, rows)
        except Exception as e:
            group.generation.fail(e)
        row += len(samples)


def score_rows(ends: EmbedAndHead, entry: _InFlight, hidden: Any) -> None:
    """The prompt's log-probabilities from a prefill sent back whole, ``PROMPT_SCORE_ROWS`` rows
    through the head at a time (not prompt x vocabulary floats at once)."""
    generation, rows = entry.parts[0][0].generation, hidden[0]
    try:
        for start in range(0, rows.shape[0], defaults.PROMPT_SCORE_ROWS):
            generation.scored_prompt(entry.scored_from + start, ends.head(
                rows[start:start + defaults.PROMPT_SCORE_ROWS]))
    except Exception as e:
        generation.fail(e)


def settle_groups(groups: Dict[int, _Group]) -> int:
    """Release every sample of ``groups`` (a rebuilt pipeline holds no rows) and keep the
    live ones, dropping groups left empty; how many samples were released."""
    released = 0
    for key, group in list(groups.items()):
        released += len(group.generation.release(group.samples))
        group.samples, group.prefilled = [s for s in group.samples if not s.done], 0
        if not group.samples:
            del groups[key]
    return released


def replay_chunks(groups: Iterable[_Group], prefill_chunk: int
                  ) -> Iterator[Tuple[_Group, Sample, plan.Chunk]]:
    """The prefill messages that replay the live samples of ``groups`` (decoded rows in runs
    that fit a prefill message too)."""
    decoded_rows = min(defaults.DECODE_ROWS, prefill_chunk or defaults.DECODE_ROWS)
    for group in groups:
        by_sid = {s.sid: s for s in group.samples}
        for sid, chunk in plan.replay([(s.sid, s.runs, len(s.prompt) + len(s.tokens))
                                       for s in group.samples], decoded_rows):
            yield group, by_sid[sid], chunk


def count_exits(parts: List[Rows], depth: int, n_layers: int) -> None:
    """Count each request's decode rows that exited after ``depth`` blocks (0: none)."""
    for group, samples in parts:
        generation = group.generation
        if generation.exits is None:
            generation.exits = ExitCounts(n_layers)
        generation.exits.add(depth, len(samples))


class InFlightMessages:
    """Messages in flight by sequence number, what was sent, and a decode row's measured cost."""

    def __init__(self) -> None:
        self.entries: Dict[int, _InFlight] = {}
        self.stats = SchedulerStats()
        self.row_cost = RowCost()  # a verified row's cost, from decode messages timed alone
        self._seq = 0

    def __len__(self) -> int:
        return len(self.entries)

    def send(self, pipeline: Pipeline, message: Message, entry: _InFlight) -> None:
        if entry.kind == "decode" and not self.entries:
            entry.sent = time.perf_counter()
        self._seq = self._seq % _ID_SPACE + 1
        message.seq = self._seq
        message.rewind = message.rewind or bool(entry.drafts)  # a verification step
        self.entries[self._seq] = entry
        pipeline.submit(message)
        self.stats.messages += 1
        self.stats.tokens += message.tokens

    def back(self, message: Message) -> _InFlight:
        """RingError for a message never sent."""
        entry = self.entries.pop(message.seq, None)
        if entry is None:
            raise RingError(f"the ring returned an unknown message (seq {message.seq})")
        if entry.sent and not self.entries:
            self.row_cost.observe(message.tokens, time.perf_counter() - entry.sent)
        return entry


class Recoverer:
    """Recovery from lost nodes, Petals-style (Borzunov et al., NeurIPS 2023): ``rebuild`` gives a
    pipeline without them and the scheduler replays every live sample through it."""

    def __init__(self, rebuild: Optional[Rebuild]) -> None:
        self.rebuild = rebuild
        self.recoveries: List[Recovery] = []
        self.fruitless = 0  # recoveries since a token was last sampled
        self.progress = time.perf_counter()  # when a message last came back

    def recover(self, lost: NodeLost, live: Sequence[Generation], tokens_so_far: int,
                restart: Callable[[Pipeline, EmbedAndHead, Recovery], None]
                ) -> Optional[MdiedgeError]:
        """None when the ``live`` requests go on without the ``lost`` nodes (``restart`` replays),
        else the error every request fails with."""
        if self.rebuild is None:
            return lost
        self.fruitless += 1
        why = plan.give_up(self.fruitless, max((len(g.recoveries) for g in live), default=0))
        if why is not None:
            return RingError(f"gave up: {why}; last: {lost}")
        started = time.perf_counter()
        record = Recovery(list(lost.nodes), tokens_so_far, started - self.progress,
                          started=started)
        for _ in range(MAX_RECOVERY_ATTEMPTS):
            try:
                restart(*self.rebuild(lost), record)
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
        for generation in live:
            generation.recoveries.append(record)
        return None


class SchedulerRequests:
    """The request side of a ``Scheduler``; the loop side steps."""

    pipeline: Pipeline
    exit_layers: int
    cache: PromptCache
    broken: Optional[BaseException]
    _waiting: Waiting
    _loop: StepLoop
    _inflight: InFlightMessages
    _requests: Dict[int, Generation]
    _live: int

    @property
    def usable(self) -> bool:
        return self.broken is None

    def step(self) -> None:
        raise NotImplementedError

    def queue(self, queued: Optional[Tuple[int, ...]] = None) -> QueueView:
        """KV slots held and requests running and queued, now (the API's 429 and metrics)."""
        running = sum(1 for g in list(self._requests.values()) if not g.settled)
        return QueueView(self.pipeline.n_slots, self._live, running,
                         self._waiting.sizes() if queued is None else queued)

    def keep_prompts(self) -> None:
        """Turn the prompt cache on (``promptcache``; not under early exit, whose rows are
        approximate)."""
        if not self.exit_layers:
            self.cache.capacity = self.pipeline.n_slots

    def submit(self, generation: Generation, micro_batch: int = 0,
               max_waiting: Optional[int] = None) -> None:
        """Queue ``generation`` until its samples fit the free KV slots; QueueFull past
        ``max_waiting``."""
        n, slots, context = len(generation.samples), self.pipeline.n_slots, self.pipeline.context
        if n > slots:
            raise GenerationError(f"{n} samples exceed the {slots} KV slots of this pipeline")
        check_context(len(generation.samples[0].prompt), generation.max_new_tokens, context,
                      where=f"the {context} set up on this pipeline")
        self._waiting.add((generation, micro_batch), lambda: self.broken, self.queue,
                          max_waiting)

    def run(self, generation: Generation, micro_batch: int = 0) -> Timing:
        self.submit(generation, micro_batch)
        return self.wait(generation)

    def wait(self, generation: Generation) -> Timing:
        """Wait until ``generation`` is done (and, failed on its own, its rows freed); its timing or
        its error. Ctrl-C cancels the request."""
        if self.usable:
            self._loop.start()
        try:
            while not generation.wait(defaults.WAIT_POLL_S):
                pass
        except BaseException:
            generation.cancel()
            raise
        if generation.error is not None:
            raise generation.error
        return generation.timing

    def drain(self) -> None:
        """Until nothing is in flight (releases included)."""
        self._loop.join()
        while self._inflight:
            self.step()


class Scheduler(SchedulerRequests):
    """Runs generations over ``pipeline`` with ``ends`` (embedding and head).

    ``prefill_chunk``: tokens per prefill message (0: the whole prompt); ``max_rows``: samples per
    decode message (0: ``prefill_chunk``); ``timeout_s``: a message's round-trip limit;
    ``max_waiting``: requests that may wait for slots; ``rebuild``: the pipeline without lost nodes,
    through which live samples are replayed (same output, except under early exit: a replay computes
    every block); ``exit_layers``: the model's blocks when decode may exit early."""

    def __init__(self, pipeline: Pipeline, ends: EmbedAndHead, prefill_chunk: int = 0,
                 timeout_s: Optional[float] = None, max_waiting: int = defaults.MAX_QUEUE,
                 max_rows: int = 0, rebuild: Optional[Rebuild] = None, exit_layers: int = 0,
                 compute: Optional[ComputeThread] = None) -> None:
        self.pipeline, self.ends = pipeline, ends
        self.exit_layers, self.max_rows = exit_layers, max_rows or prefill_chunk
        self.prefill_chunk, self.timeout_s, self.max_waiting = prefill_chunk, timeout_s, max_waiting
        self._recovery = Recoverer(rebuild)
        self._waiting = Waiting(max_waiting)
        self._driver = threading.Lock()  # held by the thread that steps
        self._loop = StepLoop(self.step, lambda: self.broken is None and bool(
            self._inflight or len(self._waiting)), compute or ComputeThread("mdiedge-scheduler"))
        self._inflight = InFlightMessages()
        self.stats = self._inflight.stats
        self._groups: Dict[int, _Group] = {}  # live groups by key, in admission order
        self._queued: Tuple[DecodeRows, ...] = ()  # decode parts waiting to merge
        self._merged = 0  # merged decode messages in flight
        self._requests: Dict[int, Generation] = {}  # admitted or dropped, not yet woken
        self._live = 0  # samples holding KV rows
        self._next_key = 0
        self.ids = SampleIds(_ID_SPACE - 1)
        self.cache = self.ids.cache  # off until ``keep_prompts``
        self.broken: Optional[BaseException] = None  # set when a step failed

    # ----------------------------------------------------------------- requests

    @property
    def idle(self) -> bool:
        """No request admitted or waiting (a RELEASE may still be on its way round)."""
        return self._live == 0 and len(self._waiting) == 0

    @property
    def slots_in_use(self) -> int:
        """KV rows held on each node: live samples' and the prompt cache's."""
        return self._live + len(self.cache)

    # ----------------------------------------------------------------- one step

    def step(self) -> None:
        """Admit what fits, take one message back and act on it, wake finished requests."""
        with self._driver:
            try:
                self._step()
            finally:
                self._wake()

    def _step(self) -> None:
        try:
            with inference():  # once for the step's stages and ends (recovery runs outside)
                self._admit()
                if not self._inflight:
                    if len(self._waiting):  # nothing runs that could free the rows it waits for
                        raise RingError(f"{self._live} KV rows are held with nothing in flight")
                    return
                message = self.pipeline.receive(self.timeout_s)
                self._recovery.progress = time.perf_counter()
                self._complete(self._inflight.back(message), message)
        except NodeLost as e:
            try:
                live = list({id(g.generation): g.generation
                             for g in self._groups.values()}.values())
                error: Optional[BaseException] = self._recovery.recover(
                    e, live, max((len(s.tokens) for g in self._groups.values()
                                  for s in g.samples), default=0), self._restart)
            except BaseException as inner:  # e.g. out of memory loading the moved layers
                error = inner
            if error is not None:
                self._fail_all(error if isinstance(error, MdiedgeError)
                               else RingError(f"interrupted while recovering: {error!r}"), error)
                raise error from None
        except BaseException as e:  # the pipeline's state is unknown now: it cannot be reused
            self._fail_all(e if isinstance(e, MdiedgeError) else RingError(f"interrupted: {e!r}"),
                           e)
            raise

    def _wake(self) -> None:
        """Wake each ended request whose rows are freed (or that failed with the pipeline)."""
        for key, generation in list(self._requests.items()):
            if generation.finished and (generation.settled or not self.usable):
                del self._requests[key]
                generation.wake()

    # ----------------------------------------------------------------- admission

    def _admit(self) -> None:
        queued = self._waiting.head()
        if not queued:
            return
        waiters = [Waiter(i, len(g.samples), len(g.samples[0].prompt), m, g.cancel_requested,
                          g.speculation is not None) for i, (g, m) in enumerate(queued)]
        decided = plan.admit(waiters, self.pipeline.n_slots - self._live, self.pipeline.nodes,
                             self.max_rows, self.prefill_chunk)
        admitted = {a.key: a for a in decided.admitted}
        for key in sorted(set(decided.dropped) | set(admitted)):  # the head of the queue
            generation = queued[key][0]
            self._requests[id(generation)] = generation
            if key in admitted:
                self._live += len(generation.samples)  # before it leaves the queue: never idle
                self._waiting.pop()
                self._start(generation, admitted[key])
            else:
                self._waiting.pop()
                generation.release(generation.samples)  # cancelled: it never held rows

    def _start(self, generation: Generation, admission: plan.Admission) -> None:
        samples = generation.samples
        reused = self._adopt(generation)
        generation.mark_admitted()
        group_of: Dict[int, _Group] = {}
        for members in admission.groups:
            self._next_key += 1
            group = _Group(self._next_key, generation, [samples[i] for i in members],
                           fixed=admission.fixed)
            self._groups[group.key] = group
            group_of.update((i, group) for i in members)
        for chunk in admission.chunks:
            sample, cached = samples[chunk.index], reused.get(chunk.index, 0)
            if chunk.end <= cached:
                continue
            start = max(chunk.start, cached)
            if plan.is_prefill_run(start, chunk.end, defaults.DECODE_ROWS):
                sample.runs.append((start, chunk.end))
            self._send(messages.ACTIVATION, [sample], [sample.prompt[start:chunk.end]],
                       [start], _InFlight("prefill", [(group_of[chunk.index], [sample])],
                                          final=chunk.final, scored_from=generation.unscored(
                                              sample, start, chunk.end)), prefill=True,
                       rewind=start == cached > 0)

    def _adopt(self, generation: Generation) -> Dict[int, int]:
        """``SampleIds.assign``; then parked rows that live samples now need go."""
        reused = self.ids.assign(generation)
        self._release_ids(self.cache.evict(self._live + len(self.cache) - self.pipeline.n_slots))
        return reused

    # ----------------------------------------------------------------- results

    def _complete(self, entry: _InFlight, message: Message) -> None:
        if entry.replay is not None:
            entry.replay.pending -= 1
            if entry.replay.pending == 0:
                entry.replay.recover_s = time.perf_counter() - entry.replay.started
        if entry.scored_from >= 0 and message.hidden is not None:
            score_rows(self.ends, entry, message.hidden)
        if entry.kind == "release" or not entry.final:
            return
        assert message.hidden is not None
        t0 = time.perf_counter()
        self._recovery.fruitless = 0
        if self.exit_layers and entry.kind == "decode":
            count_exits(entry.parts, message.exit_depth, self.exit_layers)
        accept_parts(self.ends, entry.parts, message.hidden, entry.drafts)
        self.stats.compute_s += time.perf_counter() - t0  # sends count their own time
        if entry.merged:
            self._merged -= 1
        backs = []
        for group, _ in entry.parts:
            if entry.kind == "prefill":
                group.prefilled += 1
                if group.prefilled < len(group.samples):
                    continue
                if all(g.prefilled == len(g.samples) for g in self._groups.values()
                       if g.generation is group.generation):
                    group.generation.mark_prefilled()
            if group.generation.cancel_requested:
                group.generation.end("cancelled", group.samples)
            backs.append(group.back(plan_step(group, self.pipeline.context, self.max_rows,
                                                 self._inflight.row_cost.value)))
        self._carry_out(plan.after_step(backs, self._queued, self._merged,
                                        self.pipeline.nodes, self.max_rows))

    def _carry_out(self, step: plan.StepPlan) -> None:
        for send in step.sends:
            if isinstance(send, Release):
                group = self._groups[send.group]
                done = group.generation.release(group.rows(send.sids))
                self._live -= len(done)
                self._release_ids(self.ids.park(group.generation, done))
            else:
                self._send_decode(send)
        for key in step.retired:
            del self._groups[key]
        self._queued, self._merged = step.queued, step.merged_in_flight

    def _send_decode(self, decode: Decode) -> None:
        parts = [(self._groups[p.group], self._groups[p.group].rows(p.sids))
                 for p in decode.parts]
        rows, tokens, drafts = step_rows(parts)
        self._send(messages.ACTIVATION, rows, tokens, [s.position for s in rows],
                   _InFlight("decode", parts, merged=decode.merged, drafts=drafts))

    # ----------------------------------------------------------------- sending

    def _send(self, kind: int, samples: List[Sample], tokens: Optional[List[List[int]]],
              positions: List[int], entry: _InFlight, prefill: bool = False,
              rewind: bool = False) -> None:
        t0 = time.perf_counter()
        hidden = self.ends.embed(tokens) if tokens is not None else None  # (B, T, dim)
        if not self._inflight:  # a loss is timed from here when nothing was running
            self._recovery.progress = time.perf_counter()
        self._inflight.send(self.pipeline, Message(kind, [s.sid for s in samples],
                                                   list(positions), hidden, prefill,
                                                   rewind=rewind,
                                                   all_rows=entry.scored_from >= 0), entry)
        self.stats.compute_s += time.perf_counter() - t0

    def _release_ids(self, sids: List[int]) -> None:
        """Free the KV rows of ``sids`` on every node (one RELEASE; none for no ids)."""
        if sids:
            self._inflight.send(self.pipeline, Message(messages.RELEASE, list(sids),
                                                       [0] * len(sids)), _InFlight("release"))

    # ----------------------------------------------------------------- recovery

    def _restart(self, pipeline: Pipeline, ends: EmbedAndHead, record: Recovery) -> None:
        """Go on over a rebuilt ``pipeline`` (nothing in flight there) and replay."""
        self.pipeline, self.ends = pipeline, ends
        self._inflight.entries, record.pending, record.tokens_replayed = {}, 0, 0
        self.cache.clear()  # the rebuilt pipeline holds no parked rows
        self._queued, self._merged = (), 0
        self._replay(record)

    def _replay(self, record: Recovery) -> None:
        """Replay each live sample's prompt and tokens as a prefill. Every group is settled before
        the first send, so a loss during the replay replays them all."""
        self._live -= settle_groups(self._groups)
        for group, sample, chunk in replay_chunks(self._groups.values(), self.prefill_chunk):
            tokens = (sample.prompt + sample.tokens)[chunk.start:chunk.end]
            record.tokens_replayed += len(tokens)
            record.pending += 1
            self._send(messages.ACTIVATION, [sample], [tokens], [chunk.start],
                       _InFlight("prefill", [(group, [sample])], chunk.final, record,
                                 scored_from=group.generation.unscored(sample, chunk.start,
                                                                       chunk.end)),
                       prefill=True)
        if record.pending == 0:
            record.recover_s = time.perf_counter() - record.started

    def _fail_all(self, error: BaseException, cause: BaseException) -> None:
        """The pipeline broke: every admitted and waiting request fails with ``error`` and is woken.
        """
        self.broken = cause
        self.cache.clear()
        failed = {id(g.generation): g.generation for g in self._groups.values()}
        failed.update((id(g), g) for g, _ in self._waiting.take_all())
        failed.update(self._requests)
        for generation in failed.values():
            generation.broken(error)
            generation.wake()
        self._groups, self._inflight.entries, self._live, self._requests = {}, {}, 0, {}
        self._queued, self._merged = (), 0


def run_single(model: Any, generation: Generation, micro_batch: int = 0) -> Timing:
    """Run ``generation`` on one in-process model chunk holding every block (tests, benchmarks)."""
    stage = LocalStage(model, len(generation.samples), generation.context, trim_prefill=True)
    return Scheduler(Pipeline([stage]), EmbedAndHead(model)).run(generation, micro_batch)
