"""The scheduler's decisions as pure functions of its state (no torch, I/O or threads), as vLLM's
``schedule()`` / ``update_from_output()``. A decode part carries ``width`` consecutive positions per
sample (> 1 verifying drafts); only parts of one width share a message."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ..base import defaults
from ..base.errors import Conflict

Layout = Tuple[int, int]  # a pipeline's KV slots and tokens per slot


# ----------------------------------------------------------------- sizes


def layout_for(current: Optional[Layout], usable: bool, idle: bool, wanted: Layout,
               what: str = "the ring") -> Optional[Layout]:
    """The one pipeline-size rule, local and ring: None keeps ``current`` (it holds ``wanted`` and
    is ``usable``), else the layout to set up, never smaller than a usable current one; ``Conflict``
    when that one is running and too small."""
    if current is None or not usable:
        return wanted
    if current[0] >= wanted[0] and current[1] >= wanted[1]:
        return None
    if not idle:
        raise Conflict(f"{what} is busy with a layout of {current[0]} samples x "
                       f"{current[1]} tokens, smaller than {wanted[0]} x {wanted[1]}; try "
                       "again when it is idle")
    return max(current[0], wanted[0]), max(current[1], wanted[1])


def group_size(n_samples: int, micro_batch: int, nodes: int, max_rows: int = 0) -> int:
    """``micro_batch`` if given, else enough groups to keep every node busy; at most ``max_rows``
    (0: no limit)."""
    size = micro_batch if micro_batch > 0 else max(1, math.ceil(n_samples / max(1, nodes)))
    return max(1, min(size, max_rows)) if max_rows > 0 else size


def prefill_chunks(prompt_len: int, chunk: int) -> List[Tuple[int, int]]:
    """``[start, end)`` of each prefill message (``chunk`` 0: one message)."""
    step = chunk if chunk > 0 else max(1, prompt_len)
    return [(start, min(start + step, prompt_len)) for start in range(0, prompt_len, step)]


def prefill_rows(chunk: int, max_payload: int, row_bytes: int) -> int:
    """``chunk`` (0: whole prompt), at most what a ``max_payload`` frame holds at ``row_bytes`` a
    token (>= 1)."""
    rows = max(1, max_payload // max(1, row_bytes))
    return min(rows, chunk) if chunk > 0 else rows


# ----------------------------------------------------------------- the queue


def queue_state(sizes: Sequence[int], slots: int) -> Tuple[int, int]:
    """(slots taken, requests waiting), first come first served: once one does not fit, it and all
    after wait."""
    taken = waiting = 0
    for n in sizes:
        if waiting or taken + n > slots:
            waiting += 1
        else:
            taken += n
    return taken, waiting


def may_join(waiting: int, free_slots: int, n: int, max_waiting: int) -> bool:
    """At once when it fits and none waits ahead, else while fewer than ``max_waiting`` wait."""
    return (waiting == 0 and n <= free_slots) or waiting < max_waiting


@dataclass(frozen=True)
class QueueView:
    """``slots`` KV slots, ``in_use`` by ``running`` admitted requests, and each queued request's
    samples in order. A queued request that fits is not waiting: it runs next step."""

    slots: int
    in_use: int
    running: int
    queued: Tuple[int, ...] = ()

    @property
    def waiting(self) -> int:
        return queue_state(self.queued, self.slots - self.in_use)[1]

    @property
    def slots_taken(self) -> int:
        """Held, or about to be by the queued requests that fit."""
        return self.in_use + queue_state(self.queued, self.slots - self.in_use)[0]

    def takes(self, n: int, max_waiting: int) -> bool:
        return may_join(self.waiting, self.slots - self.slots_taken, n, max_waiting)


# ----------------------------------------------------------------- admission


@dataclass(frozen=True)
class Waiter:
    """``micro_batch`` 0: as many groups as nodes. A speculating request's samples draft by their
    own acceptance, so their tokens do not depend on the group."""

    key: int
    n_samples: int
    prompt_len: int
    micro_batch: int = 0
    cancelled: bool = False
    speculating: bool = False


@dataclass(frozen=True)
class Chunk:
    """Tokens ``[start, end)`` of sample ``index``; ``final``: its last, giving the first token."""

    index: int
    start: int
    end: int
    final: bool


@dataclass(frozen=True)
class Admission:
    """Samples by group, whether an explicit micro-batch sized them (their steps then travel alone),
    and prefill messages in order."""

    key: int
    groups: Tuple[Tuple[int, ...], ...]
    fixed: bool
    chunks: Tuple[Chunk, ...]


@dataclass(frozen=True)
class AdmitPlan:
    dropped: Tuple[int, ...] = ()  # cancelled while waiting: they end, never admitted
    admitted: Tuple[Admission, ...] = ()


def chunks_of(index: int, length: int, prefill_chunk: int) -> List[Chunk]:
    return [Chunk(index, start, end, end == length)
            for start, end in prefill_chunks(length, prefill_chunk)]


def admit(waiting: Sequence[Waiter], free_slots: int, nodes: int, max_rows: int,
          prefill_chunk: int) -> AdmitPlan:
    """The head of ``waiting`` that fits, first come first served, cut into groups (one sample each
    when speculating, unless a micro-batch was asked) and chunks; a cancelled head is dropped."""
    dropped: List[int] = []
    admitted: List[Admission] = []
    for waiter in waiting:
        if waiter.cancelled:
            dropped.append(waiter.key)
            continue
        if waiter.n_samples > free_slots:
            break
        free_slots -= waiter.n_samples
        size = 1 if waiter.speculating and waiter.micro_batch <= 0 else \
            group_size(waiter.n_samples, waiter.micro_batch, nodes, max_rows)
        indices = range(waiter.n_samples)
        groups = tuple(tuple(indices[i:i + size]) for i in range(0, waiter.n_samples, size))
        chunks = tuple(c for i in indices for c in chunks_of(i, waiter.prompt_len, prefill_chunk))
        admitted.append(Admission(waiter.key, groups, waiter.micro_batch > 0, chunks))
    return AdmitPlan(tuple(dropped), tuple(admitted))


# ----------------------------------------------------------------- after a step


@dataclass(frozen=True)
class ReturnedSample:
    """``done``: ended; ``released``: its rows freed already."""

    sid: int
    done: bool = False
    released: bool = False


@dataclass(frozen=True)
class ReturnedGroup:

    group: int
    rows: Tuple[ReturnedSample, ...]
    fixed: bool = False
    width: int = 1  # positions each row computes in its next step


@dataclass(frozen=True)
class DecodeRows:

    group: int
    sids: Tuple[int, ...]
    width: int = 1


@dataclass(frozen=True)
class Release:

    group: int
    sids: Tuple[int, ...]


@dataclass(frozen=True)
class Decode:
    """``merged``: counts against the limit of merged messages."""

    parts: Tuple[DecodeRows, ...]
    merged: bool = False


Send = Union[Release, Decode]


@dataclass(frozen=True)
class StepPlan:
    """Messages to send in order, groups left empty, parts waiting to merge, merged messages in
    flight after."""

    sends: Tuple[Send, ...] = ()
    retired: Tuple[int, ...] = ()
    queued: Tuple[DecodeRows, ...] = ()
    merged_in_flight: int = 0


def verify_rows(frame_rows: int) -> int:
    """The most token rows of a message that verifies drafts: one compiled step call's (several
    samples' drafts, each sample at most ``defaults.SPECULATION_MAX_K`` + 1 rows), at most a
    frame's (``frame_rows``, 0: no limit)."""
    rows = defaults.STEP_ROWS
    return min(rows, frame_rows) if frame_rows > 0 else rows


def take_merged(queued: Sequence[DecodeRows], in_flight: int, limit: int,
                max_rows: int = 0) -> Tuple[Tuple[DecodeRows, ...], Tuple[DecodeRows, ...]]:
    """(next merged message's parts, those left): none while ``limit`` are in flight; else the first
    part and later ones of its width up to ``max_rows`` token rows; an oversized part goes alone."""
    if not queued or in_flight >= limit:
        return (), tuple(queued)
    head = queued[0]
    width = head.width
    cap = max_rows if width == 1 else verify_rows(max_rows)
    taken, rows, left = [head], len(head.sids) * width, list(queued[1:])
    while left and left[0].width == width and (
            cap <= 0 or rows + len(left[0].sids) * width <= cap):
        rows += len(left[0].sids) * width
        taken.append(left.pop(0))
    return tuple(taken), tuple(left)


def after_step(backs: Sequence[ReturnedGroup], queued: Sequence[DecodeRows],
               merged_in_flight: int, limit: int, max_rows: int = 0) -> StepPlan:
    """Each returned group frees its ended rows, then sends its next step alone (explicit
    micro-batch) or queues it to merge; merged messages leave while fewer than ``limit`` are in
    flight."""
    sends: List[Send] = []
    retired: List[int] = []
    waiting = list(queued)
    for back in backs:
        ended = tuple(r.sid for r in back.rows if r.done and not r.released)
        if ended:
            sends.append(Release(back.group, ended))
        going = tuple(r.sid for r in back.rows if not r.done)
        if not going:
            retired.append(back.group)
        elif back.fixed:
            sends.append(Decode((DecodeRows(back.group, going, back.width),)))
        else:
            waiting.append(DecodeRows(back.group, going, back.width))
    while True:
        taken, rest = take_merged(waiting, merged_in_flight, limit, max_rows)
        if not taken:
            break
        sends.append(Decode(taken, merged=True))
        waiting, merged_in_flight = list(rest), merged_in_flight + 1
    return StepPlan(tuple(sends), tuple(retired), tuple(waiting), merged_in_flight)


# ----------------------------------------------------------------- recovery

MAX_FRUITLESS_RECOVERIES = 3  # recoveries in a row with no token sampled between them
MAX_RECOVERIES_PER_REQUEST = 8  # a loss that keeps coming back fails the request


def give_up(fruitless: int, most_recoveries: int) -> Optional[str]:
    """Why recovery stops (None: it goes on): ``fruitless`` recoveries in a row sampled nothing, or
    a request lived through ``most_recoveries``."""
    if fruitless > MAX_FRUITLESS_RECOVERIES:
        return f"{MAX_FRUITLESS_RECOVERIES} recoveries in a row sampled no token"
    if most_recoveries >= MAX_RECOVERIES_PER_REQUEST:
        return f"a request lived through {MAX_RECOVERIES_PER_REQUEST} recoveries"
    return None


def is_prefill_run(start: int, end: int, decoded_rows: int) -> bool:
    """Whether a message's run of one sample's rows [start, end) is computed as a prefill (more
    rows than a decode step takes) rather than row by row as decode steps are."""
    return end - start > decoded_rows


def replay(samples: Sequence[Tuple[int, Sequence[Tuple[int, int]], int]], decoded_rows: int
           ) -> List[Tuple[int, Chunk]]:
    """(sid, chunk) of each prefill message replaying ``samples`` ((sid, prefill runs, tokens so
    far)), in order, each row computed as it first was: every prefill run (``Sample.runs``) as
    one message again (a prefill's row depends on the rows computed with it), the rows between
    (decode steps', short runs') in runs of at most ``decoded_rows``, which a node computes row
    by row as it computed them. So every replayed row equals the row it replaces, in the q8
    mode too, where a prefill's kernels round otherwise than a decode step's."""
    replayed: List[Tuple[int, Chunk]] = []
    for sid, runs, length in samples:
        cuts: List[Tuple[int, int]] = []
        at, step = 0, max(1, decoded_rows)
        for start, end in [(s, min(e, length)) for s, e in runs if s < length] + [(length, length)]:
            cuts += [(s, min(s + step, start)) for s in range(at, start, step)]
            if end > start:
                cuts.append((start, end))
            at = max(at, end)
        replayed.extend((sid, Chunk(0, start, end, end == length)) for start, end in cuts)
    return replayed
