"""The ring with real worker processes on loopback: exactness against the single process,
multi-frame prefill, weight transfer and caching, and a worker dying mid-run."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from mdiedge.base import defaults
from mdiedge.engine.local import LocalEngine
from mdiedge.base.errors import RingError
from mdiedge.roles.local_ring import LocalRing
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.ring import RingEngine

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
PROMPT = "hello ring"  # in the vocabulary of conftest.write_tiny_tokenizer


@pytest.fixture(scope="module")
def reference(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model)


def tokens_of(out: Any) -> List[List[int]]:
    return [s["token_ids"] for s in out.samples]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}-nodes")
def ring(request: Any, ring_model: Path) -> Iterator[RingEngine]:
    local = LocalRing(request.param - 1, threads=1)
    with local as workers:
        engine = RingEngine(workers, ring_model, timeout_s=30, secret=local.secret)
        engine.prepare(8, 256)
        yield engine
        engine.close()


@pytest.mark.parametrize("n_samples,micro_batch", [(1, 0), (2, 1), (3, 0), (3, 3), (5, 2), (8, 0), (8, 1), (8, 8)])
def test_greedy_equals_single_process(ring: RingEngine, reference: LocalEngine,
                                      n_samples: int, micro_batch: int) -> None:
    want = reference.generate(PROMPT, 24, n_samples, GREEDY)
    got = ring.generate(PROMPT, 24, n_samples, GREEDY, micro_batch=micro_batch)
    assert tokens_of(got) == tokens_of(want)


@pytest.mark.parametrize("micro_batch", [1, 0, 4])
def test_seeded_sampling_equals_single_process(ring: RingEngine, reference: LocalEngine,
                                               micro_batch: int) -> None:
    want = reference.generate(PROMPT, 20, 4, SAMPLED)
    got = ring.generate(PROMPT, 20, 4, SAMPLED, micro_batch=micro_batch)
    assert tokens_of(got) == tokens_of(want)


def test_stories260k_on_three_nodes(stories: Path) -> None:
    model, tok = stories / "stories260K.bin", stories / "tok512.model"
    want = LocalEngine(model, tok).generate("", 60, 3, SAMPLED)
    local = LocalRing(2)
    with local as workers:
        engine = RingEngine(workers, model, tok, secret=local.secret)
        try:
            got = engine.generate("", 60, 3, SAMPLED, micro_batch=2)
            greedy = engine.generate("", 30, 1, GREEDY)
        finally:
            engine.close()
    assert tokens_of(got) == tokens_of(want)
    assert greedy.samples[0]["text"].startswith("Once upon a time, there was a little girl named Lily.")


def test_multi_frame_prefill(ring_model: Path, reference: LocalEngine) -> None:
    prompt = "hello ring 1 the quick brown fox jumps hello ring 2 the quick brown fox"
    want = reference.generate(prompt, 16, 2, GREEDY)
    local = LocalRing(2)
    with local as workers:
        engine = RingEngine(workers, ring_model, max_payload=32 * 4 * 3,  # 3 tokens a frame
                            secret=local.secret)
        try:
            assert len(engine.encode_prompt(prompt)) > 9
            got = engine.generate(prompt, 16, 2, GREEDY)
        finally:
            engine.close()
    assert tokens_of(got) == tokens_of(want)


def test_a_long_prompt_in_default_prefill_chunks() -> None:
    """The shipped model, a prompt of several default-size prefill messages: the ring's greedy
    tokens are the single process's (whole prompt at once), for 2 samples in one message."""
    text = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    prompt = text.read_text(encoding="utf-8")[-2400:-1000] if text.exists() else \
        " ".join(f"Citizen {i}: we are accounted poor citizens." for i in range(40))
    reference = LocalEngine()
    want = reference.generate(prompt, 24, 2, GREEDY)
    assert want.as_dict()["prompt_tokens"] > 2 * defaults.PREFILL_CHUNK
    local = LocalRing(2)
    with local as workers:
        engine = RingEngine(workers, secret=local.secret)
        try:
            got = engine.generate(prompt, 24, 2, GREEDY, micro_batch=2)
            assert engine.starter.scheduler.prefill_chunk == defaults.PREFILL_CHUNK
        finally:
            engine.close()
    assert tokens_of(got) == tokens_of(want)


def test_weights_are_sent_once_then_cached(ring_model: Path, reference: LocalEngine,
                                          tmp_path: Path) -> None:
    want = tokens_of(reference.generate(PROMPT, 12, 1, GREEDY))
    local = LocalRing(2, cache_dir=str(tmp_path))
    with local as workers:
        for run in range(2):
            engine = RingEngine(workers, ring_model, share_path=False, secret=local.secret)
            try:
                assert tokens_of(engine.generate(PROMPT, 12, 1, GREEDY)) == want
            finally:
                engine.close()
            cached = sorted(p.name for p in tmp_path.glob("weights/*/*"))
            assert len(cached) == 2, cached  # one folder per worker range, written on run 0


def test_a_dead_worker_fails_the_run_fast_and_names_it(ring_model: Path) -> None:
    """With recovery off, a lost worker fails the requests in flight, naming it."""
    local = LocalRing(2)
    with local as workers:
        engine = RingEngine(workers, ring_model, timeout_s=30, secret=local.secret,
                            recover=False)
        errors: List[BaseException] = []
        started = threading.Event()

        def run() -> None:
            try:
                engine.generate(PROMPT, 230, 4, GREEDY, micro_batch=1,
                                on_token=lambda i, t: started.set())
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(60)
        os.kill(local.processes[0].pid, signal.SIGKILL)  # w1
        t0 = time.monotonic()
        thread.join(20)
        assert not thread.is_alive()
        assert time.monotonic() - t0 < 10
        engine.close()
    assert errors and isinstance(errors[0], RingError)
    assert "'w1'" in str(errors[0]) and "down" in str(errors[0])


def workers_of(parent: int) -> List[int]:
    """Pids of the worker processes started by ``parent``."""
    found: List[Tuple[float, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().split()
        except OSError:
            continue
        if b"--parent-pid" in cmd and cmd[cmd.index(b"--parent-pid") + 1] == str(parent).encode():
            found.append((float(stat[21]), int(entry.name)))
    return [pid for _, pid in sorted(found)]


def test_a_request_admitted_mid_decode_gets_its_tokens_alone(ring: RingEngine,
                                                             reference: LocalEngine) -> None:
    want_a = tokens_of(reference.generate(PROMPT, 40, 2, SAMPLED))
    want_b = tokens_of(reference.generate("the quick brown fox", 12, 3, GREEDY))
    ring.prepare(8, 256)
    mid_decode = threading.Event()
    a = ring.new_generation(PROMPT, 40, 2, SAMPLED,
                            lambda i, t: mid_decode.set() if t and i == 0 else None)
    b = ring.new_generation("the quick brown fox", 12, 3, GREEDY, None)
    runner = threading.Thread(target=ring.run, args=(a,))
    runner.start()
    assert mid_decode.wait(60)
    ring.run(b, micro_batch=1)
    runner.join(60)
    assert [s.tokens for s in a.samples] == want_a
    assert [s.tokens for s in b.samples] == want_b
    assert a.admitted_at < b.admitted_at < a.admitted_at + a.timing.total_s
