"""Each node's compute threads (a table of the pure decision), the cgroup quota that bounds
the cores, the passive OpenMP waits, and ``--threads`` reaching every node of a local ring."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mdiedge.base import threads
from mdiedge.base.threads import cgroup_cores, node_threads
from commands import MDIEDGE


@pytest.mark.parametrize("requested, nodes_here, cores, expected", [
    (0, 1, 2, 2),    # one node: every core
    (0, 3, 2, 1),    # a local ring of 3 on 2 cores: one each, at least one
    (0, 2, 8, 4),
    (0, 3, 8, 2),    # 8 // 3: never more threads in all than cores
    (0, 1, 1, 1),
    (3, 3, 2, 3),    # asked for: as asked, even beyond the cores
    (1, 1, 16, 1),
])
def test_node_threads(requested: int, nodes_here: int, cores: int, expected: int) -> None:
    assert node_threads(requested, nodes_here, cores, environ={}) == expected


@pytest.mark.parametrize("requested, told, expected", [
    (0, "1", 1), (0, "3", 3), (2, "1", 2), (0, "", 4), (0, "0", 4), (0, "many", 4),
    (0, "2,1", 4),  # a nested list: not a count this node takes
])
def test_omp_num_threads_is_the_default(requested: int, told: str, expected: int) -> None:
    assert node_threads(requested, 1, 4, environ={"OMP_NUM_THREADS": told}) == expected


@pytest.mark.parametrize("text, expected", [
    ("max 100000\n", None),
    ("200000 100000\n", 2),
    ("150000 100000", 2),   # 1.5 cores: rounded up
    ("50000 100000", 1),
    ("", None),
    (None, None),
    ("garbage", None),
    ("-1 100000", None),
    ("100000 0", None),
])
def test_cgroup_cores(text: str, expected: int) -> None:
    assert cgroup_cores(text) == expected


def test_available_cores_within_the_quota(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", str(quota))
    assert threads.available_cores() == 1
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", str(tmp_path / "absent"))
    assert threads.available_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("environ, others, cores, expected", [
    ({}, 0, 2, {"GOMP_SPINCOUNT": "3000"}),     # quiet: a short spin outlasts a barrier
    ({}, 2, 2, {"OMP_WAIT_POLICY": "PASSIVE"}),  # two busy loops on two cores
    ({}, 1, 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({}, 1, 4, {"GOMP_SPINCOUNT": "3000"}),     # less than half the cores taken
    ({}, 2, 4, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"OMP_WAIT_POLICY": "active"}, 2, 2, {}),  # the user's choice wins
    ({"GOMP_SPINCOUNT": "10"}, 0, 2, {}),
])
def test_openmp_waits(environ, others, cores, expected) -> None:
    assert threads.openmp_waits(environ, others, cores) == expected


def test_others_running_reads_proc_stat(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 4\nprocs_blocked 0\n")
    monkeypatch.setattr(threads, "PROC_STAT", str(stat))
    assert threads.others_running() == 3
    stat.write_text("cpu  1 2 3\n")
    assert threads.others_running() == 0


@pytest.mark.parametrize("given", [{}, {"OMP_WAIT_POLICY": "active"}], ids=["unset", "set"])
def test_the_command_sets_the_waits_before_anything_loads(given) -> None:
    """``python -m mdiedge`` chooses the waits first (quiet here, or busy: either choice),
    and keeps the user's."""
    env = {k: v for k, v in os.environ.items() if k not in (threads.WAIT_POLICY,
                                                              threads.SPIN_COUNT)}
    env.update(given)
    probe = ("import os, sys; from mdiedge.__main__ import main; "
             "sys.argv = ['mdiedge', '--help']; import atexit; "
             "atexit.register(lambda: print('WAITS', os.environ.get('OMP_WAIT_POLICY'), "
             "os.environ.get('GOMP_SPINCOUNT')))\n"
             "try:\n    main()\nexcept SystemExit:\n    pass")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         cwd="/")
    line = [w for w in out.stdout.splitlines() if w.startswith("WAITS")]
    assert line, out.stderr
    policy, spin = line[0].split()[1:]
    if given:
        assert (policy, spin) == ("active", "None")
    else:
        assert (policy, spin) in (("PASSIVE", "None"), ("None", "3000"))


def test_threads_flag_reaches_every_node(stories) -> None:
    from mdiedge.engine.opening import EngineSpec, open_engine

    spec = EngineSpec(model=stories / "stories260K.bin", tokenizer=stories / "tok512.model",
                      nodes=2, threads=2)
    with open_engine(spec) as engine:
        engine.generate("Once", max_new_tokens=2)
        assert [s.threads for s in engine.status()] == [2, 2]


@pytest.mark.parametrize("value", ["-1", "5000", "abc"])
def test_bad_threads_is_a_usage_error(value: str) -> None:
    out = subprocess.run([*MDIEDGE, "generate", "x", "--threads", value],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 2, out.stderr
    assert "--threads" in out.stderr or "threads" in out.stderr.lower()


@pytest.mark.parametrize("environ, expected", [
    ({}, {"OPENBLAS_NUM_THREADS": "1"}),
    ({"OMP_NUM_THREADS": "4"}, {"OPENBLAS_NUM_THREADS": "1"}),
    ({"OPENBLAS_NUM_THREADS": "3"}, {}),  # the user's
])
def test_blas_thread_setting(environ, expected) -> None:
    assert threads.blas_thread_setting(environ) == expected
