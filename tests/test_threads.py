"""Each node's compute threads (a table of the pure decision), the cgroup quota that bounds
the cores, the passive OpenMP waits, and ``--threads`` reaching every node of a local ring."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mdiedge.base import threads
from mdiedge.base.threads import cgroup_cores, node_threads


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
    assert node_threads(requested, nodes_here, cores) == expected


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


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("active", "active")])
def test_openmp_waits_passively_unless_told(given: str, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != threads.WAIT_POLICY}
    if given is not None:
        env[threads.WAIT_POLICY] = given
    probe = ("import os, sys; from mdiedge.__main__ import main; "
             "sys.argv = ['mdiedge', '--help']; "
             "import atexit; atexit.register(lambda: print('POLICY', os.environ.get('%s')))\n"
             "try:\n    main()\nexcept SystemExit:\n    pass" % threads.WAIT_POLICY)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         cwd="/")
    assert f"POLICY {expected}" in out.stdout, out.stderr


def test_threads_flag_reaches_every_node(stories) -> None:
    from mdiedge.engine.factory import EngineSpec, open_engine

    spec = EngineSpec(model=stories / "stories260K.bin", tokenizer=stories / "tok512.model",
                      nodes=2, threads=2)
    with open_engine(spec) as engine:
        engine.generate("Once", max_new_tokens=2)
        assert [s.threads for s in engine.status()] == [2, 2]


@pytest.mark.parametrize("value", ["-1", "5000", "abc"])
def test_bad_threads_is_a_usage_error(value: str) -> None:
    out = subprocess.run([sys.executable, "-m", "mdiedge", "generate", "x", "--threads", value],
                         capture_output=True, text=True, cwd="/")
    assert out.returncode == 2, out.stderr
    assert "--threads" in out.stderr or "threads" in out.stderr.lower()
