"""The one scheduler, in one process: N in-process stages give the tokens of one stage for
every grouping and prefill chunking; requests admitted mid-decode get the tokens they get
alone; finished and cancelled samples free their KV rows on every stage; failures fail every
request in flight."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from mdiedge.base.errors import ContextExceeded, GenerationError, QueueFull, RingError
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.local import LocalEngine
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.messages import Message
from mdiedge.runtime.plan import QueueView
from mdiedge.runtime.scheduler import Scheduler, group_size, prefill_chunks

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
PROMPT = "hello ring"


@pytest.fixture(scope="module")
def model_dir(ring_model: Path) -> Path:
    return ring_model


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Dict[Tuple[int, int], LocalEngine]:
    """(stages, prefill chunk) -> engine; chunk 0 is the whole prompt in one message."""
    pairs = [(n, 0) for n in (1, 2, 3, 4)] + [(1, 2), (3, 2)]
    return {(n, chunk): LocalEngine(model_dir, stages=n, prefill_chunk=chunk) for n, chunk in pairs}


def tokens(out: Any) -> List[List[int]]:
    return [s["token_ids"] for s in out.samples]


# ------------------------------------------------------------------------------ pure decisions


@pytest.mark.parametrize("n,micro_batch,nodes,max_rows,want", [
    (1, 0, 1, 0, 1), (8, 0, 1, 0, 8), (8, 0, 3, 0, 3), (8, 0, 4, 0, 2), (3, 0, 4, 0, 1),
    (8, 3, 2, 0, 3), (8, 5, 2, 4, 4), (8, 0, 1, 2, 2), (5, 9, 1, 0, 9), (2, 0, 0, 0, 2),
])
def test_group_size(n: int, micro_batch: int, nodes: int, max_rows: int, want: int) -> None:
    assert group_size(n, micro_batch, nodes, max_rows) == want


@pytest.mark.parametrize("length,chunk,want", [
    (1, 0, [(0, 1)]), (5, 0, [(0, 5)]), (5, 2, [(0, 2), (2, 4), (4, 5)]), (4, 2, [(0, 2), (2, 4)]),
    (3, 8, [(0, 3)]), (1, 1, [(0, 1)]),
])
def test_prefill_chunks(length: int, chunk: int, want: List[Tuple[int, int]]) -> None:
    assert prefill_chunks(length, chunk) == want


# ------------------------------------------------------------------------------ exactness


def test_stages_split_the_layers_like_a_ring(engines: Dict[Tuple[int, int], LocalEngine]) -> None:
    assert engines[(1, 0)].ranges == [(0, 6)]
    for n in (2, 3, 4):
        ranges = engines[(n, 0)].ranges
        assert len(ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == 6
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("n_samples", range(1, 9))
def test_n_stages_equal_one_stage_for_every_grouping(engines: Dict[Tuple[int, int], LocalEngine],
                                                     n_samples: int) -> None:
    want = tokens(engines[(1, 0)].generate(PROMPT, 10, n_samples, GREEDY))
    for (stages, chunk), engine in engines.items():
        for micro_batch in range(0, n_samples + 1):
            got = tokens(engine.generate(PROMPT, 10, n_samples, GREEDY, micro_batch=micro_batch))
            assert got == want, (stages, chunk, micro_batch)


@pytest.mark.parametrize("micro_batch", [0, 1, 3])
def test_seeded_sampling_is_the_same_on_every_pipeline(engines: Dict[Tuple[int, int], LocalEngine],
                                                       micro_batch: int) -> None:
    want = tokens(engines[(1, 0)].generate(PROMPT, 16, 4, SAMPLED))
    for engine in engines.values():
        assert tokens(engine.generate(PROMPT, 16, 4, SAMPLED, micro_batch=micro_batch)) == want


def test_every_kv_row_is_free_after_a_run(engines: Dict[Tuple[int, int], LocalEngine]) -> None:
    engine = engines[(3, 2)]
    engine.generate(PROMPT, 8, 5, GREEDY, micro_batch=2)
    engine.scheduler.drain()
    assert [s.slots_in_use for s in engine.stages] == [0, 0, 0]
    assert engine.scheduler.slots_in_use == 0 and engine.scheduler.idle


# ------------------------------------------------------------------------------ continuous batching


def step_until(scheduler: Scheduler, done: Any) -> None:
    for _ in range(10_000):
        if done():
            return
        scheduler.step()
    raise AssertionError("the scheduler made no progress")


@pytest.mark.parametrize("stages", [1, 3])
def test_a_request_admitted_mid_decode_gets_its_tokens_alone(model_dir: Path, stages: int) -> None:
    engine = LocalEngine(model_dir, stages=stages)
    alone_a = engine.generate(PROMPT, 30, 2, SAMPLED)
    alone_b = engine.generate("the quick brown fox", 12, 3, GREEDY)
    scheduler = engine.prepare(8, 128)
    a = engine.new_generation(PROMPT, 30, 2, SAMPLED, None)
    b = engine.new_generation("the quick brown fox", 12, 3, GREEDY, None)
    scheduler.submit(a)
    step_until(scheduler, lambda: len(a.samples[0].tokens) >= 10)
    scheduler.submit(b, micro_batch=1)  # enters while a decodes
    step_until(scheduler, lambda: a.finished and b.finished)
    assert [s.tokens for s in a.samples] == tokens(alone_a)
    assert [s.tokens for s in b.samples] == tokens(alone_b)
    assert not b.samples[0].tokens or a.admitted_at < b.admitted_at


def test_a_request_waits_for_free_rows_then_runs(model_dir: Path) -> None:
    engine = LocalEngine(model_dir, stages=2)
    alone = tokens(engine.generate(PROMPT, 6, 1, GREEDY))
    scheduler = engine.prepare(2, 64)  # two KV rows in all
    first = engine.new_generation(PROMPT, 20, 2, GREEDY, None)
    second = engine.new_generation(PROMPT, 6, 1, GREEDY, None)
    scheduler.submit(first)
    scheduler.submit(second)
    step_until(scheduler, lambda: len(first.samples[0].tokens) >= 5)
    assert second.admitted_at == 0.0 and not second.samples[0].tokens  # no free row yet
    step_until(scheduler, lambda: second.finished)
    assert first.finished and [s.tokens for s in second.samples] == alone


def test_a_finished_request_frees_its_rows_on_every_stage_at_once(model_dir: Path) -> None:
    engine = LocalEngine(model_dir, stages=3)
    scheduler = engine.prepare(8, 128)
    short = engine.new_generation(PROMPT, 3, 2, GREEDY, None)
    long = engine.new_generation(PROMPT, 40, 3, GREEDY, None)
    scheduler.submit(long)
    scheduler.submit(short)
    step_until(scheduler, lambda: short.finished)
    scheduler.step()  # the RELEASE goes through every stage as it is sent
    assert [s.slots_in_use for s in engine.stages] == [3, 3, 3]
    step_until(scheduler, lambda: long.finished)
    scheduler.drain()
    assert [s.slots_in_use for s in engine.stages] == [0, 0, 0]


def test_cancel_frees_the_rows_and_spares_the_others(model_dir: Path) -> None:
    engine = LocalEngine(model_dir, stages=2)
    alone = tokens(engine.generate(PROMPT, 25, 2, SAMPLED))
    scheduler = engine.prepare(8, 128)
    kept = engine.new_generation(PROMPT, 25, 2, SAMPLED, None)
    dropped = engine.new_generation(PROMPT, 100, 3, GREEDY, None)
    scheduler.submit(kept)
    scheduler.submit(dropped)
    step_until(scheduler, lambda: len(dropped.samples[0].tokens) >= 4)
    dropped.cancel()
    step_until(scheduler, lambda: dropped.finished)
    assert {s.finish_reason for s in dropped.samples} == {"cancelled"}
    assert all(len(s.tokens) < 100 for s in dropped.samples)
    step_until(scheduler, lambda: kept.finished)
    scheduler.drain()
    assert [s.tokens for s in kept.samples] == alone
    assert [s.slots_in_use for s in engine.stages] == [0, 0]


def test_a_request_cancelled_while_waiting_never_runs(model_dir: Path) -> None:
    engine = LocalEngine(model_dir)
    scheduler = engine.prepare(1, 64)
    running = engine.new_generation(PROMPT, 10, 1, GREEDY, None)
    waiting = engine.new_generation(PROMPT, 10, 1, GREEDY, None)
    scheduler.submit(running)
    scheduler.submit(waiting)
    waiting.cancel()
    step_until(scheduler, lambda: running.finished and waiting.finished)
    assert waiting.admitted_at == 0.0 and waiting.samples[0].finish_reason == "cancelled"


def test_threads_run_requests_together(model_dir: Path) -> None:
    engine = LocalEngine(model_dir, stages=2)
    prompts = ["hello ring", "the quick brown fox", "jumps", "ring 1"]
    alone = [tokens(engine.generate(p, 15, 2, SAMPLED)) for p in prompts]
    engine.prepare(8, 128)
    got: Dict[int, List[List[int]]] = {}

    def run(i: int) -> None:
        got[i] = tokens(engine.generate(prompts[i], 15, 2, SAMPLED))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(4)] == alone


# ------------------------------------------------------------------------------ refusals, failures


def test_requests_beyond_the_pipeline_are_refused(model_dir: Path) -> None:
    engine = LocalEngine(model_dir)
    scheduler = engine.prepare(2, 32)
    with pytest.raises(GenerationError, match="3 samples exceed the 2 KV slots"):
        scheduler.submit(engine.new_generation(PROMPT, 4, 3, GREEDY, None))
    with pytest.raises(GenerationError, match="exceeds the 32 set up"):
        scheduler.submit(engine.new_generation(PROMPT, 40, 1, GREEDY, None))


def test_the_scheduler_decides_whether_a_request_may_queue(model_dir: Path) -> None:
    """The queue's rule is the scheduler's (the API's 429 asks it): a request that fits the
    free slots is taken at once, one that does not waits while fewer than ``max_waiting``
    wait, else QueueFull."""
    engine = LocalEngine(model_dir)
    scheduler = engine.prepare(2, 64)
    first = engine.new_generation(PROMPT, 10, 2, GREEDY, None)
    second = engine.new_generation(PROMPT, 10, 1, GREEDY, None)
    third = engine.new_generation(PROMPT, 10, 1, GREEDY, None)
    scheduler.submit(first, max_waiting=0)  # queued, but it fits: not waiting
    assert scheduler.queue() == QueueView(2, 0, 0, (2,)) and scheduler.queue().waiting == 0
    with pytest.raises(QueueFull, match="0 requests are waiting for the 2 KV slots"):
        scheduler.submit(second, max_waiting=0)
    scheduler.submit(second, max_waiting=1)
    with pytest.raises(QueueFull, match="1 requests are waiting"):
        scheduler.submit(third, max_waiting=1)
    assert scheduler.queue().waiting == 1
    scheduler.wait(first)
    scheduler.wait(second)
    scheduler.drain()
    assert scheduler.queue() == QueueView(2, 0, 0, ())


def test_a_budget_beyond_the_context_is_one_error_type(model_dir: Path) -> None:
    engine = LocalEngine(model_dir)
    with pytest.raises(ContextExceeded, match="plus 100000 new tokens exceeds the context"):
        engine.new_generation(PROMPT, 100_000, 1, GREEDY, None)
    scheduler = engine.prepare(1, 32)
    with pytest.raises(ContextExceeded, match="exceeds the 32 set up"):
        scheduler.submit(engine.new_generation(PROMPT, 40, 1, GREEDY, None))


class _Failing:
    """A stage that fails on its ``fail_at``-th message."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner, self.fail_at, self.seen = inner, fail_at, 0
        self.n_slots, self.context = inner.n_slots, inner.context

    def forward(self, message: Message) -> Message:
        self.seen += 1
        if self.seen == self.fail_at:
            raise RingError("stage 1 lost its node")
        return self.inner.forward(message)


def test_a_failing_stage_fails_every_request_and_the_pipeline_is_rebuilt(model_dir: Path) -> None:
    engine = LocalEngine(model_dir, stages=2)
    want = tokens(engine.generate(PROMPT, 8, 1, GREEDY))
    scheduler = engine.prepare(4, 64)
    pipeline = scheduler.pipeline
    pipeline.stages[1] = _Failing(pipeline.stages[1], fail_at=6)
    a = engine.new_generation(PROMPT, 20, 1, GREEDY, None)
    b = engine.new_generation(PROMPT, 20, 2, GREEDY, None)
    scheduler.submit(a)
    with pytest.raises(RingError, match="lost its node"):
        scheduler.run(b)
    assert a.error is b.error and isinstance(a.error, RingError)
    assert not scheduler.usable
    assert tokens(engine.generate(PROMPT, 8, 1, GREEDY)) == want  # a fresh pipeline


def test_an_unknown_message_is_an_error(model_dir: Path) -> None:
    engine = LocalEngine(model_dir)
    scheduler = engine.prepare(1, 64)
    pipeline = scheduler.pipeline
    real = pipeline.receive

    def stray(timeout: Any = None) -> Message:
        message = real(timeout)
        message.seq += 1000
        return message

    pipeline.receive = stray  # type: ignore[assignment]
    with pytest.raises(RingError, match="unknown message"):
        scheduler.run(engine.new_generation(PROMPT, 4, 1, GREEDY, None))


def test_generation_timing_is_filled(engines: Dict[Tuple[int, int], LocalEngine]) -> None:
    generation = Generation(ids_request([1, 5, 6], 6, 2, GREEDY, 64), ())
    engines[(2, 0)].run(generation)
    t = generation.timing
    assert t.new_tokens == 12 and t.total_s > 0 and t.prefill_s > 0 and t.decode_s > 0
    assert t.prefill_s + t.decode_s <= t.total_s + 1e-6


def test_a_request_that_fails_on_its_own_spares_the_others(model_dir: Path) -> None:
    engine = LocalEngine(model_dir, stages=2)
    alone = tokens(engine.generate(PROMPT, 20, 2, SAMPLED))
    scheduler = engine.prepare(8, 128)
    kept = engine.new_generation(PROMPT, 20, 2, SAMPLED, None)

    def broken_pipe(index: int, token: int) -> None:
        raise BrokenPipeError("the client went away")

    failing = engine.new_generation(PROMPT, 20, 2, GREEDY, broken_pipe)
    scheduler.submit(kept)
    with pytest.raises(GenerationError, match="BrokenPipeError: the client went away"):
        scheduler.run(failing)
    assert failing.settled and scheduler.usable
    assert scheduler.wait(kept) and [s.tokens for s in kept.samples] == alone
    scheduler.drain()
    assert [s.slots_in_use for s in engine.stages] == [0, 0]


# ------------------------------------------------------------------------------ the loop


def test_one_loop_thread_samples_every_request(model_dir: Path) -> None:
    """Requests waited for on threads of their own: every token is sampled (and its
    callback run) on the scheduler's one loop thread, never on a request's thread."""
    engine = LocalEngine(model_dir, stages=2)
    scheduler = engine.prepare(8, 128)
    seen: Dict[int, set] = {0: set(), 1: set()}
    waiters: Dict[int, int] = {}

    def on_token(i: int) -> Any:
        return lambda index, token: seen[i].add(threading.get_ident())

    generations = [engine.new_generation(PROMPT, 12, 2, SAMPLED, on_token(i)) for i in (0, 1)]

    def run(i: int) -> None:
        waiters[i] = threading.get_ident()
        scheduler.run(generations[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g.finished and not g.error for g in generations)
    assert len(seen[0] | seen[1]) == 1  # one thread sampled both requests
    assert not (seen[0] | seen[1]) & set(waiters.values())
    assert threading.get_ident() not in seen[0]


def test_a_raising_callback_or_a_cancel_does_not_stop_the_loop(model_dir: Path) -> None:
    """A token callback that raises fails its own request; a request cancelled from another
    thread ends; the loop goes on with the others and with requests that come later."""
    engine = LocalEngine(model_dir, stages=2)
    alone = tokens(engine.generate(PROMPT, 16, 1, GREEDY))
    scheduler = engine.prepare(8, 128)

    def raising(index: int, token: int) -> None:
        raise ValueError("a callback bug")

    failing = engine.new_generation(PROMPT, 16, 1, GREEDY, raising)
    cancelled = engine.new_generation(PROMPT, 100, 1, GREEDY,
                                      lambda index, token: cancelled.cancel())
    kept = engine.new_generation(PROMPT, 16, 1, GREEDY, None)
    for generation in (failing, cancelled, kept):
        scheduler.submit(generation)
    with pytest.raises(GenerationError, match="ValueError: a callback bug"):
        scheduler.wait(failing)
    assert scheduler.wait(cancelled) is not None
    assert cancelled.samples[0].finish_reason == "cancelled"
    scheduler.wait(kept)
    assert [s.tokens for s in kept.samples] == alone and scheduler.usable
    later = engine.new_generation(PROMPT, 16, 1, GREEDY, None)
    scheduler.run(later)
    assert [s.tokens for s in later.samples] == alone
    scheduler.drain()
    assert [s.slots_in_use for s in engine.stages] == [0, 0]


def test_an_interrupted_wait_cancels_its_request_and_the_loop_frees_it(model_dir: Path) -> None:
    """Ctrl-C reaches the waiting thread, not the loop: the request is cancelled, its rows
    are freed, and the scheduler stays usable."""
    engine = LocalEngine(model_dir, stages=2)
    scheduler = engine.prepare(2, 128)
    generation = engine.new_generation(PROMPT, 100, 2, GREEDY, None)

    def interrupted(timeout: Any = None) -> bool:
        raise KeyboardInterrupt

    generation.wait = interrupted  # type: ignore[method-assign]
    scheduler.submit(generation)
    with pytest.raises(KeyboardInterrupt):
        scheduler.wait(generation)
    assert generation.cancel_requested
    scheduler.drain()
    assert {s.finish_reason for s in generation.samples} == {"cancelled"}
    assert [s.slots_in_use for s in engine.stages] == [0, 0] and scheduler.usable


def test_busy_time_is_counted(engines: Dict[Tuple[int, int], LocalEngine]) -> None:
    engine = engines[(2, 0)]
    scheduler = engine.prepare(4, 64)
    before = scheduler.stats.compute_s
    out = engine.generate(PROMPT, 12, 2, GREEDY)
    compute = scheduler.stats.compute_s - before
    assert 0 < compute <= out.timing.generation_s * 1.05


@pytest.mark.parametrize("shape, positions, match", [
    ((1, 1, 7), [0], r"activation \(1, 1, 7\) with 1 positions for 1 samples of width"),
    ((1, 1, 0), [0], r"activation \(1, 1, 0\)"),
    ((2, 1, -1), [0, 0], r"for 1 samples"),  # -1: the model's width
    ((1, 1, -1), [0, 0], r"2 positions for 1 samples"),
    ((1, 1, -1), [0x7fffffff], r"positions 2147483647..2147483647 outside the context of 64"),
    ((1, 4, -1), [62], r"positions 62..65 outside the context of 64"),
])
def test_a_stage_refuses_an_activation_that_does_not_fit_in_one_line(
        model_dir: Path, shape: Tuple[int, int, int], positions: List[int], match: str) -> None:
    """What only a peer's bug or a forged frame sends: a one-line RingError, nothing run."""
    import torch

    from mdiedge.runtime import messages
    from mdiedge.runtime.stages import LocalStage
    from mdiedge.model.checkpoint import load_model

    model = load_model(model_dir, embedding=False, head=False)
    stage = LocalStage(model, n_slots=2, context=64)
    dim = shape[2] if shape[2] >= 0 else model.cfg.dim
    hidden = torch.zeros(shape[0], shape[1], dim)
    message = Message(messages.ACTIVATION, [1], positions, hidden, prefill=True)
    with pytest.raises(RingError, match=match):
        stage.forward(message)
    assert stage.slots_in_use == 0
