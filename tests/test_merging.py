"""Decode steps of different requests travel in one message (continuous batching across
requests): the merger's rule as a table, and on in-process stages the same tokens as alone
in far fewer messages; an explicit micro-batch still travels alone."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.local import LocalEngine
from mdiedge.runtime.plan import DecodeRows, take_merged

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3)
PROMPTS = ["hello ring", "the quick brown fox", "jumps", "ring 1", "fox 7", "quick"]


@pytest.mark.parametrize("rows, in_flight, limit, max_rows, taken", [
    ([], 0, 3, 0, []),                       # nothing waits
    ([1, 2], 3, 3, 0, []),                   # the limit is in flight: they wait
    ([1, 2, 3], 2, 3, 0, [1, 2, 3]),         # all leave together
    ([1, 2, 3], 0, 3, 3, [1, 2]),            # up to max_rows rows
    ([4, 1], 0, 3, 3, [4]),                  # one part over max_rows still leaves, alone
])
def test_the_merger_takes_waiting_parts_in_order(rows: List[int], in_flight: int, limit: int,
                                                 max_rows: int, taken: List[int]) -> None:
    queued = [DecodeRows(i, tuple(range(n))) for i, n in enumerate(rows)]
    got, left = take_merged(queued, in_flight, limit, max_rows)
    assert [len(p.sids) for p in got] == taken
    assert [len(p.sids) for p in left] == rows[len(taken):]


@pytest.fixture(scope="module")
def engine(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model, stages=2)


def run_together(engine: LocalEngine, params: SamplingParams, micro_batch: int = 0,
                 n: int = 1) -> Dict[int, List[List[int]]]:
    """Every prompt submitted at once, stepped by one thread each; tokens by prompt."""
    generations = [engine.new_generation(p, 20, n, params, None) for p in PROMPTS]
    scheduler = engine.prepare(16, 64)
    for generation in generations:
        scheduler.submit(generation, micro_batch)
    threads = [threading.Thread(target=scheduler.wait, args=(g,), daemon=True)
               for g in generations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a request did not finish within 60 s"
    return {i: [s.tokens for s in g.samples] for i, g in enumerate(generations)}


def messages(engine: LocalEngine, run: Any) -> int:
    before = engine.prepare(16, 64).stats.messages
    run()
    return engine.prepare(16, 64).stats.messages - before


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
def test_requests_decode_together_with_the_tokens_they_get_alone(engine: LocalEngine,
                                                                 params: SamplingParams) -> None:
    alone = {i: [s["token_ids"] for s in engine.generate(p, 20, 1, params).samples]
             for i, p in enumerate(PROMPTS)}
    got: Dict[int, List[List[int]]] = {}
    sent = messages(engine, lambda: got.update(run_together(engine, params)))
    assert got == alone
    # alone, each request sends a prefill, 19 decode steps and a release: 6 x 21 messages
    assert sent < 0.6 * len(PROMPTS) * 21


def test_an_explicit_micro_batch_still_travels_alone(engine: LocalEngine) -> None:
    sent = messages(engine, lambda: run_together(engine, GREEDY, micro_batch=1))
    assert sent >= len(PROMPTS) * 20  # a prefill and 19 decode steps each, never merged


def test_a_request_cancelled_while_merged_frees_its_rows_and_spares_the_others(
        engine: LocalEngine) -> None:
    alone = [s["token_ids"] for s in engine.generate(PROMPTS[1], 20, 1, GREEDY).samples]
    scheduler = engine.prepare(16, 64)
    kept = engine.new_generation(PROMPTS[1], 20, 1, GREEDY, None)
    dropped = [engine.new_generation(p, 40, 1, GREEDY, None) for p in PROMPTS[2:]]

    def cancel_at_five(index: int, token: int) -> None:
        if len(dropped[0].samples[0].tokens) >= 5:
            dropped[0].cancel()

    dropped[0].on_token = cancel_at_five
    for generation in [kept] + dropped:
        scheduler.submit(generation)
    threads = [threading.Thread(target=scheduler.wait, args=(g,)) for g in [kept] + dropped]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    scheduler.drain()
    assert [s.tokens for s in kept.samples] == alone
    assert dropped[0].samples[0].finish_reason == "cancelled"
    assert len(dropped[0].samples[0].tokens) < 10
    assert [s.slots_in_use for s in engine.stages] == [0, 0]
