"""A node's torch work on one thread (``mdiedge.runtime.compute``): the engine loads its
model, sets its KV slots up and samples every token on its compute thread, whichever thread
asked; the thread runs jobs in order, hands back results and errors, and ends with its
owner."""
from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest

import mdiedge.engine.local as local
import mdiedge.runtime.stages as stages
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.compute import ComputeThread
from mdiedge.engine.local import LocalEngine

PROMPT = "Once upon a time"
GREEDY = SamplingParams(temperature=0.0)


def test_jobs_run_in_order_on_one_thread_with_results_and_errors() -> None:
    compute = ComputeThread("test-compute")
    seen: List[int] = []
    futures = [compute.submit(lambda i=i: seen.append(i) or threading.get_ident())
               for i in range(20)]
    idents = {f.result(10) for f in futures}
    assert seen == list(range(20)) and len(idents) == 1
    assert threading.get_ident() not in idents
    assert compute.call(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    assert compute.call(lambda: threading.get_ident()) in idents  # still the same thread


def test_a_call_from_the_thread_itself_runs_at_once() -> None:
    """A job that calls ``call`` would wait for itself if it were queued."""
    compute = ComputeThread("test-compute")
    assert compute.call(lambda: compute.here() and compute.call(lambda: 7)) == 7
    assert not compute.here()


def test_the_thread_ends_with_its_owner() -> None:
    compute = ComputeThread("test-compute-ends")
    compute.call(lambda: None)
    thread = compute._thread
    assert thread is not None and thread.is_alive()
    del compute
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_the_engine_loads_sets_up_and_samples_on_one_thread(
        ring_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading (the main thread asks), the KV set-up (a request thread asks) and every
    token of requests waited for on two threads: all on the engine's compute thread."""
    seen: Dict[str, Set[int]] = {"load": set(), "kv": set(), "token": set()}
    real_load, real_stage = local.open_chunk, stages.LocalStage.__init__

    def open_chunk(*args: Any, **kwargs: Any) -> Any:
        seen["load"].add(threading.get_ident())
        return real_load(*args, **kwargs)

    def stage_init(self: Any, *args: Any, **kwargs: Any) -> None:
        seen["kv"].add(threading.get_ident())
        real_stage(self, *args, **kwargs)

    monkeypatch.setattr(local, "open_chunk", open_chunk)
    monkeypatch.setattr(stages.LocalStage, "__init__", stage_init)
    engine = LocalEngine(ring_model, stages=2)
    errors: List[BaseException] = []

    def run() -> None:
        try:
            generation = engine.new_generation(
                PROMPT, 8, 2, GREEDY, lambda i, t: seen["token"].add(threading.get_ident()))
            engine.run(generation)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    compute = engine.compute.call(threading.get_ident)
    assert seen == {"load": {compute}, "kv": {compute}, "token": {compute}}
    assert threading.get_ident() != compute


def test_a_request_waited_for_on_the_compute_thread_is_stepped_there(
        ring_model: Path) -> None:
    """A caller already on the compute thread (a tool that runs its work there) steps the
    scheduler itself instead of waiting for a loop queued behind it."""
    engine = LocalEngine(ring_model)
    expected = engine.generate(PROMPT, 8, 1, GREEDY)
    started = time.monotonic()
    again = engine.compute.call(engine.generate, PROMPT, 8, 1, GREEDY)
    assert time.monotonic() - started < 60
    assert again.samples == expected.samples


def test_closing_ends_the_thread_after_its_work_and_a_later_job_starts_another() -> None:
    compute = ComputeThread("test-compute-close")
    seen: List[int] = []
    compute.submit(lambda: time.sleep(0.2) or seen.append(1))
    first = compute._thread
    compute.close()
    assert seen == [1] and first is not None and not first.is_alive()
    assert compute.call(lambda: 2) == 2 and compute._thread is not first


def test_closing_an_engine_ends_its_compute_thread(ring_model: Path) -> None:
    engine = LocalEngine(ring_model)
    engine.generate(PROMPT, 4, 1, GREEDY)
    thread = engine.compute._thread
    engine.close()
    assert thread is not None and not thread.is_alive()
