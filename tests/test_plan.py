"""The scheduler's planning step as tables: admission under the slot limit, grouping into
micro-batches, prefill chunks, what follows a step (releases, decode steps alone or merged),
the queue's rule, and when recovery gives up. Pure functions: no model, no threads."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import pytest

from mdiedge.runtime import plan
from mdiedge.runtime.plan import (Chunk, Decode, DecodeRows, QueueView, Release, ReturnedGroup,
                                  ReturnedSample, Waiter, admit, after_step, give_up,
                                  queue_state, take_merged)

# ------------------------------------------------------------------------------ admission


@pytest.mark.parametrize("sizes, cancelled, free, admitted, dropped", [
    ([1, 2, 3], [], 8, [0, 1, 2], []),          # all fit
    ([4, 4, 1], [], 8, [0, 1], []),             # the third waits for rows
    ([2, 5, 1], [], 6, [0], []),                # first come, first served: 1 waits behind 5
    ([3], [], 2, [], []),                       # nothing fits
    ([2, 2], [0], 2, [1], [0]),                 # a cancelled head is dropped, never admitted
    ([5, 2], [1], 2, [], []),                   # a cancelled one behind a wait stays queued
    ([], [], 4, [], []),
])
def test_admission_under_the_slot_limit(sizes: List[int], cancelled: List[int], free: int,
                                        admitted: List[int], dropped: List[int]) -> None:
    waiting = [Waiter(i, n, 3, cancelled=i in cancelled) for i, n in enumerate(sizes)]
    got = admit(waiting, free, nodes=2, max_rows=0, prefill_chunk=0)
    assert [a.key for a in got.admitted] == admitted
    assert list(got.dropped) == dropped


@pytest.mark.parametrize("n, micro_batch, nodes, max_rows, groups, fixed, speculating", [
    (4, 0, 2, 0, ((0, 1), (2, 3)), False, False),           # as many groups as nodes
    (5, 0, 2, 0, ((0, 1, 2), (3, 4)), False, False),
    (5, 0, 3, 0, ((0, 1), (2, 3), (4,)), False, False),
    (4, 1, 2, 0, ((0,), (1,), (2,), (3,)), True, False),    # an explicit micro-batch: alone
    (4, 0, 1, 3, ((0, 1, 2), (3,)), False, False),          # never more rows than a frame
    (1, 0, 4, 0, ((0,),), False, False),
    # speculating: a group each, the same on any ring (their steps merge by width)
    (3, 0, 1, 0, ((0,), (1,), (2,)), False, True),
    (3, 0, 3, 0, ((0,), (1,), (2,)), False, True),
    (4, 2, 1, 0, ((0, 1), (2, 3)), True, True),              # unless a micro-batch is asked
])
def test_samples_group_into_micro_batches(n: int, micro_batch: int, nodes: int, max_rows: int,
                                          groups: Tuple[Tuple[int, ...], ...], fixed: bool,
                                          speculating: bool) -> None:
    got = admit([Waiter(7, n, 2, micro_batch, speculating=speculating)], 8, nodes, max_rows,
                0).admitted[0]
    assert (got.key, got.groups, got.fixed) == (7, groups, fixed)


@pytest.mark.parametrize("n, prompt_len, chunk, want", [
    (1, 5, 0, [(0, 0, 5, True)]),
    (1, 5, 2, [(0, 0, 2, False), (0, 2, 4, False), (0, 4, 5, True)]),
    (2, 3, 2, [(0, 0, 2, False), (0, 2, 3, True), (1, 0, 2, False), (1, 2, 3, True)]),
    (2, 1, 4, [(0, 0, 1, True), (1, 0, 1, True)]),
])
def test_prompts_are_cut_into_prefill_chunks_in_sending_order(
        n: int, prompt_len: int, chunk: int, want: List[Tuple[int, int, int, bool]]) -> None:
    got = admit([Waiter(0, n, prompt_len)], 8, 1, 0, chunk).admitted[0].chunks
    assert got == tuple(Chunk(*c) for c in want)


@pytest.mark.parametrize("max_payload, row_bytes, chunk, rows", [
    (1000, 100, 0, 10), (1000, 100, 4, 4), (1000, 100, 40, 10), (50, 100, 0, 1),
])
def test_prefill_rows_fit_a_frame(max_payload: int, row_bytes: int, chunk: int,
                                  rows: int) -> None:
    assert plan.prefill_rows(chunk, max_payload, row_bytes) == rows


# ------------------------------------------------------------------------------ after a step


def back(group: int, rows: str, fixed: bool = False, width: int = 1) -> ReturnedGroup:
    """A group's rows as letters: ``l`` live, ``d`` done (rows held), ``r`` done and
    released already; sample ids count from group * 10."""
    return ReturnedGroup(group, tuple(ReturnedSample(group * 10 + i, c != "l", c == "r")
                                      for i, c in enumerate(rows)), fixed, width)


@pytest.mark.parametrize("backs, queued, in_flight, limit, max_rows, sends, retired, left", [
    # one group decoding alone, nothing ends: its next step merges (limit permitting)
    ([back(1, "ll")], [], 0, 2, 0, [Decode((DecodeRows(1, (10, 11)),), True)], [], []),
    # a sample ended: its rows are freed before the next step of the others
    ([back(1, "ld")], [], 0, 2, 0,
     [Release(1, (11,)), Decode((DecodeRows(1, (10,)),), True)], [], []),
    # every sample ended: a release, and the group retires
    ([back(1, "dd")], [], 0, 2, 0, [Release(1, (10, 11))], [1], []),
    # released already (a recovery settled it): nothing to free again
    ([back(1, "rl")], [], 0, 2, 0, [Decode((DecodeRows(1, (11,)),), True)], [], []),
    # an explicit micro-batch travels alone, never merged
    ([back(1, "l", fixed=True)], [], 2, 2, 0, [Decode((DecodeRows(1, (10,)),))], [], []),
    # the limit of merged messages is in flight: the step waits to merge
    ([back(1, "l")], [DecodeRows(2, (20,))], 2, 2, 0, [], [],
     [DecodeRows(2, (20,)), DecodeRows(1, (10,))]),
    # two requests' steps leave in one message, in the order they queued
    ([back(1, "l")], [DecodeRows(2, (20,))], 1, 2, 0,
     [Decode((DecodeRows(2, (20,)), DecodeRows(1, (10,))), True)], [], []),
    # up to max_rows rows a message; the rest leave in another while the limit allows
    ([back(1, "ll"), back(3, "l")], [DecodeRows(2, (20,))], 1, 2, 3,
     [Decode((DecodeRows(2, (20,)), DecodeRows(1, (10, 11))), True)], [], [DecodeRows(3, (30,))]),
    ([back(1, "ll"), back(3, "l")], [DecodeRows(2, (20,))], 0, 3, 3,
     [Decode((DecodeRows(2, (20,)), DecodeRows(1, (10, 11))), True),
      Decode((DecodeRows(3, (30,)),), True)],
     [], []),
    # rows of several positions (a speculative step) never share a message with single ones
    ([back(1, "l", width=3)], [DecodeRows(2, (20,))], 0, 3, 0,
     [Decode((DecodeRows(2, (20,)),), True), Decode((DecodeRows(1, (10,), 3),), True)], [], []),
    # rows of width 3 count as 3 token rows each against max_rows: 2 x 3 fits 6, not 3 more
    ([back(1, "ll", width=3), back(3, "l", width=3)], [], 0, 2, 6,
     [Decode((DecodeRows(1, (10, 11), 3),), True), Decode((DecodeRows(3, (30,), 3),), True)],
     [], []),
    ([back(1, "l", width=3), back(3, "l", width=3)], [], 0, 2, 6,
     [Decode((DecodeRows(1, (10,), 3), DecodeRows(3, (30,), 3)), True)], [], []),
    # with no row limit (one process), verifications still merge within one step call's 32 rows
    ([back(1, "llll", width=8), back(3, "l", width=8)], [], 0, 2, 0,
     [Decode((DecodeRows(1, (10, 11, 12, 13), 8),), True),
      Decode((DecodeRows(3, (30,), 8),), True)], [], []),
    ([back(1, "lll", width=8), back(3, "l", width=8)], [], 0, 2, 0,
     [Decode((DecodeRows(1, (10, 11, 12), 8), DecodeRows(3, (30,), 8)), True)], [], []),
    ([back(1, "l", width=5), back(3, "l", width=5)], [], 0, 2, 0,
     [Decode((DecodeRows(1, (10,), 5), DecodeRows(3, (30,), 5)), True)], [], []),
    # releases and steps in group order
    ([back(1, "d", fixed=True), back(2, "ld", fixed=True)], [], 0, 1, 0,
     [Release(1, (10,)), Release(2, (21,)), Decode((DecodeRows(2, (20,)),))], [1], []),
])
def test_what_follows_a_step(backs: List[ReturnedGroup], queued: List[DecodeRows],
                             in_flight: int, limit: int, max_rows: int, sends: list,
                             retired: List[int],
                             left: List[DecodeRows]) -> None:
    got = after_step(backs, queued, in_flight, limit, max_rows)
    assert list(got.sends) == sends
    assert list(got.retired) == retired
    assert list(got.queued) == left
    assert got.merged_in_flight == in_flight + sum(1 for s in sends
                                                   if isinstance(s, Decode) and s.merged)


@pytest.mark.parametrize("widths, taken", [
    ([1, 1, 2, 1], 2), ([2, 2, 1], 2), ([3], 1),
])
def test_only_rows_of_one_width_merge(widths: List[int], taken: int) -> None:
    queued = [DecodeRows(i, (i,), w) for i, w in enumerate(widths)]
    got, left = take_merged(queued, 0, 4)
    assert len(got) == taken and list(got) + list(left) == queued


# ------------------------------------------------------------------------------ the queue


@pytest.mark.parametrize("slots, in_use, queued, n, max_waiting, takes, waiting", [
    (8, 0, (), 1, 0, True, 0),          # fits the free slots: runs at once, no queue needed
    (8, 6, (1,), 1, 0, True, 0),        # queued but fitting is not waiting
    (8, 6, (1,), 2, 0, False, 0),       # does not fit and no queue
    (8, 8, (), 1, 2, True, 0),          # waits
    (8, 8, (1,), 1, 2, True, 1),        # others wait ahead: it queues behind them
    (8, 8, (1, 1), 1, 2, False, 2),     # the queue is full
    (8, 4, (5, 1), 1, 3, True, 2),      # first come, first served: the 1 waits behind the 5
])
def test_the_queue_takes_or_refuses(slots: int, in_use: int, queued: Tuple[int, ...], n: int,
                                    max_waiting: int, takes: bool, waiting: int) -> None:
    view = QueueView(slots, in_use, 1, queued)
    assert view.waiting == waiting
    assert view.takes(n, max_waiting) is takes


@pytest.mark.parametrize("sizes, slots, state", [
    ([], 8, (0, 0)), ([1, 1, 1], 8, (3, 0)), ([4, 4], 8, (8, 0)), ([4, 4, 1], 8, (8, 1)),
    ([4, 5, 1], 8, (4, 2)), ([9], 8, (0, 1)),
])
def test_requests_take_slots_in_the_order_they_came(sizes: List[int], slots: int,
                                                     state: Tuple[int, int]) -> None:
    assert queue_state(sizes, slots) == state


# ------------------------------------------------------------------------------ recovery


@pytest.mark.parametrize("fruitless, most, why", [
    (1, 0, None), (3, 7, None),
    (4, 0, "3 recoveries in a row sampled no token"),
    (1, 8, "a request lived through 8 recoveries"),
])
def test_when_recovery_gives_up(fruitless: int, most: int, why: Optional[str]) -> None:
    assert give_up(fruitless, most) == why


@pytest.mark.parametrize("samples, decoded, want", [
    ([(5, [], 3)], 8, [(5, 0, 3, True)]),  # a short prompt, nothing decoded yet
    ([(5, [], 2), (6, [], 4)], 1, [(5, 0, 1, False), (5, 1, 2, True), (6, 0, 1, False),
                                   (6, 1, 2, False), (6, 2, 3, False), (6, 3, 4, True)]),
    # prefill runs as they were; the rows between (short chunks, decoded tokens) in runs of 8
    ([(7, [(0, 128), (128, 256), (256, 300)], 310)], 8,
     [(7, 0, 128, False), (7, 128, 256, False), (7, 256, 300, False), (7, 300, 308, False),
      (7, 308, 310, True)]),
    ([(7, [(0, 128)], 150)], 8, [(7, 0, 128, False), (7, 128, 136, False), (7, 136, 144, False),
                                 (7, 144, 150, True)]),
    # a prompt cache's rows: the earlier request's runs, then this prompt's own from the reuse
    ([(9, [(0, 20), (30, 60)], 70)], 8, [(9, 0, 20, False), (9, 20, 28, False),
                                         (9, 28, 30, False), (9, 30, 60, False),
                                         (9, 60, 68, False), (9, 68, 70, True)]),
    ([(9, [(0, 20), (30, 60)], 40)], 8, [(9, 0, 20, False), (9, 20, 28, False),
                                         (9, 28, 30, False), (9, 30, 40, True)]),  # cut short
])
def test_a_replay_computes_each_row_as_it_first_was(samples: Sequence[Tuple[int, List, int]],
                                                    decoded: int,
                                                    want: List[Tuple[int, int, int, bool]]) -> None:
    got = plan.replay(samples, decoded)
    assert [(sid, c.start, c.end, c.final) for sid, c in got] == want


@pytest.mark.parametrize("start, end, prefill", [(0, 8, False), (0, 9, True), (40, 41, False)])
def test_a_run_of_more_rows_than_a_decode_step_takes_is_a_prefill(start: int, end: int,
                                                                  prefill: bool) -> None:
    assert plan.is_prefill_run(start, end, 8) is prefill


@pytest.mark.parametrize("current, usable, idle, wanted, expected", [
    (None, False, True, (2, 64), (2, 64)),  # nothing yet: as wanted
    ((4, 128), False, True, (2, 64), (2, 64)),  # broken: anew, as wanted
    ((4, 128), True, True, (2, 64), None),  # holds it: kept
    ((4, 128), True, False, (4, 128), None),  # running and holds it: kept
    ((4, 128), True, True, (8, 64), (8, 128)),  # idle, too few slots: never smaller
    ((4, 128), True, True, (2, 256), (4, 256)),  # idle, too short
    ((4, 128), True, False, (8, 64), "busy with a layout of 4 samples x 128 tokens"),
])
def test_a_pipeline_is_kept_grown_or_refused_by_one_rule(current, usable, idle, wanted,
                                                         expected) -> None:
    from mdiedge.base.errors import Conflict
    from mdiedge.runtime.plan import layout_for

    if isinstance(expected, str):
        with pytest.raises(Conflict, match=expected):
            layout_for(current, usable, idle, wanted)
    else:
        assert layout_for(current, usable, idle, wanted) == expected
