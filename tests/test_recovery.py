"""Recovery from a lost node: the scheduler's replay in one process (a pipeline that fails on
cue), then real worker processes killed (SIGKILL) or frozen (SIGSTOP) at a random token, with
and without a spare, twice in one generation, and when the survivors cannot hold the layers.
The output must equal the single-process output token for token."""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import pytest

from mdiedge.base.errors import GenerationError, NodeLost, PartitionError, RingError
from mdiedge.base.nodes import NodeSpec
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.local import LocalEngine
from mdiedge.model.checkpoint import load_config
from mdiedge.roles.local_ring import LocalRing
from mdiedge.roles.starter import RingStarter, StarterOptions
from mdiedge.engine.ring import RingEngine
from mdiedge.placement.partition import choose_members
from mdiedge.runtime.pipeline import EmbedAndHead, Pipeline
from mdiedge.runtime.scheduler import MAX_FRUITLESS_RECOVERIES, Scheduler
from mdiedge.runtime.stages import LocalStage
from commands import MDIEDGE

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
PROMPT = "hello ring"  # in the vocabulary of conftest.write_tiny_tokenizer
STALL_S = 2.0


def spec(name: str, spare: bool = False) -> NodeSpec:
    return NodeSpec(name, spare=spare)


@pytest.mark.parametrize("nodes, lost, expected", [
    (["a", "b", "c"], set(), ["a", "b", "c"]),
    (["a", "b", "c"], {"b"}, ["a", "c"]),
    (["a", "b", "s1*"], set(), ["a", "b"]),                  # a spare is held back
    (["a", "b", "s1*"], {"a"}, ["s1", "b"]),                 # it takes the lost one's place
    (["a", "b", "s1*"], {"a", "b"}, ["s1"]),                 # one spare, two lost
    (["a", "b", "s1*", "s2*"], {"a", "b"}, ["s1", "s2"]),
    (["a", "b", "s1*"], {"a", "s1"}, ["b"]),                 # a lost spare is no spare
    (["a"], {"a"}, []),
])
def test_choose_members(nodes: List[str], lost: set, expected: List[str]) -> None:
    specs = [spec(n.rstrip("*"), n.endswith("*")) for n in nodes]
    assert [n.name for n in choose_members(specs, lost)] == expected


# ------------------------------------------------------------------ in one process


class FailingPipeline(Pipeline):
    """In-process stages whose ``receive`` raises ``NodeLost`` on the given receive counts
    (and ``submit`` on the given submit counts)."""

    def __init__(self, stages: Sequence[LocalStage], fail_at: Sequence[int],
                 fail_submit: Sequence[int] = ()) -> None:
        super().__init__(stages)
        self.fail_at, self.received = set(fail_at), 0
        self.fail_submit, self.submitted = set(fail_submit), 0

    def submit(self, message: Any) -> None:
        self.submitted += 1
        if self.submitted in self.fail_submit:
            raise NodeLost(f"worker 'w1' is down (submit {self.submitted})", ("w1",))
        super().submit(message)

    def receive(self, timeout: Optional[float] = None) -> Any:
        self.received += 1
        if self.received in self.fail_at:
            raise NodeLost(f"worker 'w1' is down (receive {self.received})", ("w1",))
        return super().receive(timeout)


def stages_of(engine: LocalEngine, n_slots: int, context: int) -> List[LocalStage]:
    last = len(engine.chunks) - 1
    return [LocalStage(c, n_slots, context, trim_prefill=i == last)
            for i, c in enumerate(engine.chunks)]


@pytest.fixture(scope="module")
def reference(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model)


@pytest.fixture(scope="module")
def split(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model, stages=3)


def run_failing(engine: LocalEngine, params: SamplingParams, n: int, micro_batch: int,
                first: Sequence[int], rebuilt: Callable[[int], Sequence[int]],
                prefill_chunk: int = 0) -> Any:
    """A generation on a pipeline that fails at receive counts ``first``; the k-th rebuilt
    pipeline fails at ``rebuilt(k)``."""
    rebuilds = []

    def rebuild(lost: NodeLost) -> Any:
        rebuilds.append(lost)
        return (FailingPipeline(stages_of(engine, 8, 256), rebuilt(len(rebuilds))),
                EmbedAndHead(engine.model))

    generation = engine.new_generation(PROMPT, 24, n, params, None)
    scheduler = Scheduler(FailingPipeline(stages_of(engine, 8, 256), first),
                          EmbedAndHead(engine.model), prefill_chunk, rebuild=rebuild)
    scheduler.run(generation, micro_batch)
    return generation


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("n, micro_batch, chunk", [(1, 0, 0), (4, 1, 0), (4, 0, 3), (4, 2, 0)])
@pytest.mark.parametrize("fail_at", [2, 7, 12])
def test_replay_in_one_process_gives_the_same_tokens(
        reference: LocalEngine, split: LocalEngine, params: SamplingParams, n: int,
        micro_batch: int, chunk: int, fail_at: int) -> None:
    want = [s["token_ids"] for s in reference.generate(PROMPT, 24, n, params).samples]
    generation = run_failing(split, params, n, micro_batch, [fail_at], lambda k: [],
                             prefill_chunk=chunk)
    assert [s.tokens for s in generation.samples] == want
    (record,) = generation.recoveries
    assert record.nodes == ["w1"] and record.tokens_replayed >= n * 3
    assert record.recover_s > 0 and record.pending == 0


def test_two_failures_and_a_failed_set_up(reference: LocalEngine, split: LocalEngine) -> None:
    want = [s["token_ids"] for s in reference.generate(PROMPT, 24, 4, SAMPLED).samples]
    # lost at receive 5; the first rebuilt pipeline is lost at once; the second at receive 20
    generation = run_failing(split, SAMPLED, 4, 1, [5], lambda k: {1: [1], 2: [20]}.get(k, []))
    assert [s.tokens for s in generation.samples] == want
    assert len(generation.recoveries) == 3


@pytest.mark.parametrize("first_submits, rebuilt_submits", [
    ([], [2]),        # lost again while the replay is being sent: every group replayed again
    ([7], []),        # lost on a send after results were accepted (a decode or a RELEASE)
    ([12], [1, 3]),   # both, twice
])
def test_a_loss_while_sending_loses_nothing(reference: LocalEngine, split: LocalEngine,
                                            first_submits: List[int],
                                            rebuilt_submits: List[int]) -> None:
    want = [s["token_ids"] for s in reference.generate(PROMPT, 24, 3, SAMPLED).samples]
    rebuilds: List[NodeLost] = []

    def rebuild(lost: NodeLost) -> Any:
        rebuilds.append(lost)
        return (FailingPipeline(stages_of(split, 8, 256), [],
                                rebuilt_submits if len(rebuilds) == 1 else []),
                EmbedAndHead(split.model))

    generation = split.new_generation(PROMPT, 24, 3, SAMPLED, None)
    first = FailingPipeline(stages_of(split, 8, 256), [] if first_submits else [5], first_submits)
    scheduler = Scheduler(first, EmbedAndHead(split.model), rebuild=rebuild)
    scheduler.run(generation, 1)
    assert [s.tokens for s in generation.samples] == want
    assert scheduler.usable and scheduler.idle and scheduler.slots_in_use == 0
    assert generation.timing.total_s > 0 and rebuilds


def test_a_request_that_failed_on_its_own_and_then_a_loss(split: LocalEngine) -> None:
    """One request's token callback fails (it ends, its rows freed as its messages come
    back); a worker is then lost before they all came back: the other request goes on, and
    nothing is left holding rows."""
    def bad(index: int, token: int) -> None:
        if index == 1:
            raise ValueError("the client went away")

    failing = split.new_generation(PROMPT, 24, 2, GREEDY, bad)
    other = split.new_generation(PROMPT, 24, 2, SAMPLED, None)
    scheduler = Scheduler(FailingPipeline(stages_of(split, 8, 256), [9]), EmbedAndHead(split.model),
                          rebuild=lambda lost: (Pipeline(stages_of(split, 8, 256)),
                                                EmbedAndHead(split.model)))
    scheduler.submit(failing, 1)
    scheduler.submit(other, 1)
    with pytest.raises(GenerationError, match="the client went away"):
        scheduler.wait(failing)
    scheduler.wait(other)
    assert all(s.done for s in other.samples) and other.recoveries
    assert scheduler.slots_in_use == 0 and scheduler.idle


def test_an_error_while_recovering_fails_every_request(split: LocalEngine) -> None:
    def rebuild(lost: NodeLost) -> Any:
        raise OSError(28, "No space left on device")

    generation = split.new_generation(PROMPT, 24, 2, GREEDY, None)
    scheduler = Scheduler(FailingPipeline(stages_of(split, 8, 256), [4]),
                          EmbedAndHead(split.model), rebuild=rebuild)
    with pytest.raises(RingError, match="No space left on device"):  # the request's error
        scheduler.run(generation)
    assert not scheduler.usable and isinstance(scheduler.broken, OSError)
    assert "interrupted while recovering" in str(generation.error)


def test_recovery_that_samples_nothing_gives_up(split: LocalEngine) -> None:
    with pytest.raises(RingError, match="recoveries in a row sampled no token"):
        run_failing(split, GREEDY, 2, 0, [1], lambda k: [1])
    assert MAX_FRUITLESS_RECOVERIES == 3


def test_a_rebuild_that_cannot_hold_the_layers_fails_every_request(split: LocalEngine) -> None:
    def rebuild(lost: NodeLost) -> Any:
        raise PartitionError("node 'w2' needs 4 MiB but declares memory 1 MiB")

    generation = split.new_generation(PROMPT, 24, 2, GREEDY, None)
    scheduler = Scheduler(FailingPipeline(stages_of(split, 8, 256), [6]),
                          EmbedAndHead(split.model), rebuild=rebuild)
    with pytest.raises(RingError, match="lost w1 and cannot recover: node 'w2' needs 4 MiB"):
        scheduler.run(generation)
    assert not scheduler.usable


# ------------------------------------------------------------------ real processes


def ring_engine(local: LocalRing, workers: List[NodeSpec], model: Path, **changes: Any
                ) -> RingEngine:
    return RingEngine(workers, model, secret=local.secret, timeout_s=30, stall_s=STALL_S,
                      **changes)


def generate_and_break(engine: RingEngine, hits: Dict[int, Callable[[], None]],
                       params: SamplingParams, n: int, micro_batch: int) -> Any:
    """Generate, running ``hits[k]`` (a kill, a freeze) when the k-th token is sampled."""
    count = [0]

    def on_token(index: int, token: int) -> None:
        count[0] += 1
        action = hits.pop(count[0], None)
        if action is not None:
            action()

    return engine.generate(PROMPT, 40, n, params, micro_batch, on_token)


def kill(local: LocalRing, name: str, sig: int = signal.SIGKILL) -> Callable[[], None]:
    pid = local.processes[[w.name for w in local.workers].index(name)].pid
    return lambda: os.kill(pid, sig)


CASES = [  # (nodes, params, samples, micro_batch)
    (3, GREEDY, 1, 0),
    (3, SAMPLED, 4, 0),
    (4, SAMPLED, 4, 1),
    (4, GREEDY, 4, 2),
]


@pytest.mark.parametrize("nodes, params, n, micro_batch", CASES)
def test_kill_a_worker_at_a_random_token(reference: LocalEngine, ring_model: Path, nodes: int,
                                         params: SamplingParams, n: int,
                                         micro_batch: int) -> None:
    want = reference.generate(PROMPT, 40, n, params)
    rng = random.Random(f"{nodes}-{n}-{micro_batch}")
    local = LocalRing(nodes - 1)
    with local as workers:
        engine = ring_engine(local, workers, ring_model)
        victim = rng.choice([w.name for w in workers])
        at = rng.randint(2, sum(len(s["token_ids"]) for s in want.samples) - 2)
        out = generate_and_break(engine, {at: kill(local, victim)}, params, n, micro_batch)
        assert [w.name for w in engine.starter.ring_workers] == \
            [w.name for w in workers if w.name != victim]
        engine.close()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    (record,) = out.recoveries
    assert record.nodes == [victim] and record.tokens_replayed > 0, (victim, at)


def test_a_frozen_worker_is_replaced_within_the_stall_time(reference: LocalEngine,
                                                           ring_model: Path) -> None:
    want = reference.generate(PROMPT, 40, 4, GREEDY)
    local = LocalRing(3)
    with local as workers:
        engine = ring_engine(local, workers, ring_model)
        try:
            out = generate_and_break(engine, {9: kill(local, "w2", signal.SIGSTOP)}, GREEDY, 4, 1)
        finally:
            kill(local, "w2", signal.SIGCONT)()
        engine.close()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    (record,) = out.recoveries
    assert record.nodes == ["w2"]
    assert record.detect_s < STALL_S + 1.5, record  # half the stall waiting, half asking


def test_a_spare_takes_the_lost_workers_layers(reference: LocalEngine, ring_model: Path) -> None:
    want = reference.generate(PROMPT, 40, 2, SAMPLED)
    local = LocalRing(2, spares=1)
    with local as workers:
        engine = ring_engine(local, workers, ring_model)
        engine.prepare(8, 256)
        before = [p.layers for p in engine.starter.placements]
        assert [w.name for w in engine.starter.ring_workers] == ["w1", "w2"]
        out = generate_and_break(engine, {6: kill(local, "w1")}, SAMPLED, 2, 0)
        assert [w.name for w in engine.starter.ring_workers] == ["spare1", "w2"]
        assert [p.layers for p in engine.starter.placements] == before
        assert engine.starter.status().state == "degraded"
        engine.close()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]


def test_two_workers_lost_in_one_generation(reference: LocalEngine, ring_model: Path) -> None:
    want = reference.generate(PROMPT, 40, 3, SAMPLED)
    local = LocalRing(3)
    with local as workers:
        engine = ring_engine(local, workers, ring_model)
        out = generate_and_break(engine, {5: kill(local, "w1"), 60: kill(local, "w3")},
                                 SAMPLED, 3, 1)
        assert [w.name for w in engine.starter.ring_workers] == ["w2"]
        assert engine.starter.recoveries == 2
        engine.close()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    assert [r.nodes for r in out.recoveries] == [["w1"], ["w3"]]


def test_survivors_that_cannot_hold_the_layers_say_so(ring_model: Path) -> None:
    local = LocalRing(2)
    with local as workers:
        probe = ring_engine(local, workers, ring_model)
        probe.prepare(2, 256)
        need = {p.name: p.total_bytes for p in probe.starter.placements}
        probe.close()
        tight = [dataclasses.replace(w, memory=need[w.name]) for w in workers]
        engine = RingEngine(tight, ring_model, secret=local.secret, timeout_s=30,
                            stall_s=STALL_S, memory=need["starter"])
        with pytest.raises(RingError, match=r"lost w1 and cannot recover: .*declares memory"):
            generate_and_break(engine, {4: kill(local, "w1")}, GREEDY, 2, 0)
        engine.close()


def test_a_lost_worker_rejoins_at_the_next_request(reference: LocalEngine, ring_model: Path,
                                                   tmp_path: Path) -> None:
    """A worker killed mid-generation and started again on its port (as systemd's Restart=
    does) rejoins at the next request: status degraded, then healthy."""
    from test_operations import SECRET, spawn, stop

    procs = [spawn(["worker", "--control-port", "0", "--data-port", "0", "--name", f"w{i}",
                    "--log-level", "warning"]) for i in (1, 2)]
    workers = [NodeSpec(f"w{i}", "127.0.0.1", info["control_port"]) for i, (_, info) in
               zip((1, 2), procs)]
    engine = RingEngine(workers, ring_model, secret=SECRET.encode(), timeout_s=30,
                        stall_s=STALL_S)
    try:
        want = reference.generate(PROMPT, 40, 2, GREEDY)
        out = generate_and_break(engine, {5: lambda: procs[1][0].kill()}, GREEDY, 2, 0)
        assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
        assert engine.starter.status().state == "degraded"
        down = {s.name: s.state for s in engine.starter.node_status()}
        assert down == {"w1": "busy", "w2": "down"}
        procs[1] = spawn(["worker", "--control-port", str(workers[1].control_port),
                          "--data-port", "0", "--name", "w2", "--log-level", "warning"])
        deadline = time.monotonic() + 15
        while not engine.starter.membership.rejoin.is_set() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.starter.membership.rejoin.is_set(), "w2 was not seen again within 15 s"
        again = engine.generate(PROMPT, 40, 2, GREEDY)
        assert [s["token_ids"] for s in again.samples] == [s["token_ids"] for s in want.samples]
        assert [w.name for w in engine.starter.ring_workers] == ["w1", "w2"]
        assert engine.starter.status().state != "degraded"
        assert engine.starter.status().recoveries == 1
    finally:
        engine.close()
        for proc, _ in procs:
            stop(proc)


def test_the_long_lived_starter_serves_degraded_then_takes_the_worker_back(
        stories: Path, tmp_path: Path) -> None:
    """``mdiedge starter`` with two workers: one is killed, the next request is served by the
    survivor and ``mdiedge status`` exits 75 (degraded); the worker is started again on its
    port (as systemd's Restart= does), rejoins, and status exits 0."""
    import json
    import subprocess

    from test_operations import SECRET, spawn, stop

    def worker(name: str, port: int = 0) -> Any:
        return spawn(["worker", "--control-port", str(port), "--data-port", "0", "--name", name,
                      "--log-level", "warning"])

    def status() -> Any:
        return subprocess.run([*MDIEDGE, "status", "--starter", url,
                               "--json"], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, MDIEDGE_SECRET=SECRET))

    def generate() -> Dict[str, Any]:
        from mdiedge.runtime.control import call
        from mdiedge.runtime.auth import Authenticator

        return call(url, "POST", "/generate", {"prompt": "Once", "max_new_tokens": 20,
                                               "temperature": 0.0}, timeout=120,
                    node="starter", auth=Authenticator(SECRET.encode()))

    workers = [worker("w1"), worker("w2")]
    ring = tmp_path / "ring.toml"
    ring.write_text('[starter]\nstall_s = 2\n' + "".join(
        f'[[workers]]\nname = "w{i + 1}"\nhost = "127.0.0.1"\ncontrol_port = {info["control_port"]}\n'
        for i, (_, info) in enumerate(workers)))
    starter, info = spawn(["starter", "--config", str(ring), "--control-port", "0",
                           "--model", str(stories / "stories260K.bin"),
                           "--tokenizer", str(stories / "tok512.model"), "--log-level", "warning"])
    url = f"http://127.0.0.1:{info['control_port']}"
    try:
        want = generate()["samples"][0]["token_ids"]
        assert status().returncode == 0
        port = workers[1][1]["control_port"]
        workers[1][0].kill()
        workers[1][0].wait()
        unnoticed = status()  # no request since: the starter does not know yet
        assert unnoticed.returncode == 69, unnoticed.stdout + unnoticed.stderr
        assert generate()["samples"][0]["token_ids"] == want  # served without w2
        degraded = status()
        assert degraded.returncode == 75, degraded.stdout + degraded.stderr
        nodes = {n["name"]: n for n in json.loads(degraded.stdout)["nodes"]}
        assert nodes["starter"]["state"] == "degraded" and nodes["w2"]["state"] == "down"
        assert nodes["starter"]["lost"] == ["w2"]
        assert nodes["starter"]["layers"][0] == 0 and nodes["w1"]["layers"][1] == 5  # all 5 blocks
        assert nodes["w2"]["layers"] is None
        workers[1] = worker("w2", port)
        deadline = time.monotonic() + 20
        while status().returncode != 0 and time.monotonic() < deadline:
            generate()  # the ring is set up anew at a request boundary once w2 answers
            time.sleep(0.5)
        healthy = json.loads(status().stdout)
        assert not healthy["degraded"] and healthy["down"] == []
        assert [n["layers"] is not None for n in healthy["nodes"]] == [True, True, True]
        assert generate()["samples"][0]["token_ids"] == want
    finally:
        stop(starter)
        for proc, _ in workers:
            stop(proc)


def test_generate_goes_on_when_a_worker_of_its_local_ring_is_killed(stories: Path) -> None:
    """``mdiedge generate --nodes 3`` in a terminal-less pipe: a worker killed while it
    streams; the text equals the one-process text and the command exits 0."""
    import subprocess

    from test_ring import workers_of

    args = [*MDIEDGE, "generate", "Once upon", "-n", "300",
            "--temperature", "0", "--model", str(stories / "stories260K.bin"),
            "--tokenizer", str(stories / "tok512.model"), "--stall-timeout", str(STALL_S)]
    alone = subprocess.run(args + ["--nodes", "1"], capture_output=True, text=True, timeout=120)
    proc = subprocess.Popen(args + ["--nodes", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    head = proc.stdout.read(len("Once upon") + 30)
    pids = workers_of(proc.pid)
    assert len(pids) == 2 and proc.poll() is None
    os.kill(pids[0], signal.SIGKILL)
    rest = proc.stdout.read()  # not communicate(): it would skip what the pipe's buffer holds
    proc.wait(120)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, err
    assert head + rest == alone.stdout
    assert "recovering: worker 'w1'" in err  # the starter's one warning line


def test_concurrent_requests_all_complete_when_a_worker_dies(reference: LocalEngine,
                                                             ring_model: Path) -> None:
    """Three requests decoding together (their steps merged into shared messages) when a
    worker is killed: each completes with what it gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(GREEDY, 1), (SAMPLED, 2), (dataclasses.replace(SAMPLED, seed=5), 1)]
    want = [[s["token_ids"] for s in reference.generate(PROMPT, 40, n, p).samples]
            for p, n in jobs]
    local = LocalRing(2)
    with local as workers:
        engine = ring_engine(local, workers, ring_model)
        engine.starter.ensure(8, 256)
        killer = kill(local, "w2")
        count = [0]

        def on_token(index: int, token: int) -> None:
            count[0] += 1
            if count[0] == 25:
                killer()

        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(engine.generate, PROMPT, 40, n, p, 0, on_token)
                       for p, n in jobs]
            outs = [f.result(timeout=120) for f in futures]
        engine.close()
    assert [[s["token_ids"] for s in out.samples] for out in outs] == want
    assert any(out.recoveries for out in outs)


def test_a_recovery_of_a_ring_closed_meanwhile_gives_up(ring_model: Path) -> None:
    """A scheduler's loop recovering while another request sets a new ring up (it holds the
    set-up lock and waits for that loop to end, on the one compute thread): the recovery
    of the closed ring gives up at once instead of waiting for the lock for ever."""
    starter = RingStarter(ring_model, load_config(ring_model), [NodeSpec("w1", control_port=1)],
                          StarterOptions())
    ring = starter.rings
    held, done = threading.Event(), threading.Event()

    def set_up_anew() -> None:
        with starter.setup_lock:
            starter.close_ring()
            held.set()
            done.wait(30)

    other = threading.Thread(target=set_up_anew)
    other.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        with pytest.raises(RingError, match="closed while recovering"):
            starter.rebuild(NodeLost("w1 is gone", ("w1",)), ring)
        assert time.monotonic() - started < 5
    finally:
        done.set()
        other.join(10)
        starter.close()
