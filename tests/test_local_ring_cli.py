"""``mdiedge generate`` on a local ring: every node process is gone afterwards, however the
command ends, and a rerun right away works (free ports, nothing fixed)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import List

import pytest

from test_ring import workers_of
from commands import MDIEDGE


def command(stories: Path, *extra: str) -> List[str]:
    return [*MDIEDGE, "generate", "Once upon", "--model",
            str(stories / "stories260K.bin"), "--tokenizer", str(stories / "tok512.model"), *extra]


def wait_gone(pids: List[int], seconds: float = 10) -> List[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if not pids:
            return []
        time.sleep(0.1)
    return pids


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return False


def test_two_runs_back_to_back_leave_no_process(stories: Path) -> None:
    for _ in range(2):
        proc = subprocess.Popen(command(stories, "-n", "40", "--nodes", "3", "--json"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60  # its two workers, seen while it runs
        while len(workers_of(proc.pid)) < 2 and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        children = workers_of(proc.pid)
        assert len(children) == 2
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        result = json.loads(out)
        assert result["nodes"] == 3 and len(result["samples"][0]["token_ids"]) == 40
        assert wait_gone(children) == []


def test_a_run_ends_soon_after_its_last_token(stories: Path) -> None:
    """Its workers stop at once and no process unloads its modules (about 2.5 s before)."""
    proc = subprocess.Popen(command(stories, "-n", "20", "--nodes", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    last = time.monotonic()
    while os.read(proc.stdout.fileno(), 4096):
        last = time.monotonic()
    proc.wait(60)
    assert proc.returncode == 0
    assert time.monotonic() - last < 1.5


@pytest.mark.parametrize("signum, group", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                           (signal.SIGINT, True)],
                         ids=["SIGINT", "SIGTERM", "Ctrl-C"])
def test_interrupted_run_leaves_no_process(stories: Path, signum: int, group: bool) -> None:
    """SIGINT or SIGTERM to the command, or Ctrl-C in its terminal (SIGINT to its process
    group, the workers included: they leave it to the command, which stops them)."""
    proc = subprocess.Popen(command(stories, "-n", "480", "--nodes", "3", "--samples", "16",
                                    "--micro-batch", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=group)
    deadline = time.monotonic() + 60
    while len(workers_of(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    children = workers_of(proc.pid)
    assert len(children) == 2
    time.sleep(1.0)
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "Traceback" not in err
    if group:
        assert proc.returncode == 130 and err.splitlines() == ["mdiedge: error: interrupted"], err
    assert wait_gone(children) == []


def test_killed_starter_takes_its_workers_with_it(stories: Path) -> None:
    proc = subprocess.Popen(command(stories, "-n", "480", "--nodes", "3", "--samples", "4"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(workers_of(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    children = workers_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_gone(children) == []


def test_a_worker_killed_while_the_ring_starts_is_named_with_how_it_ended(stories: Path) -> None:
    """Killed before it said it was ready: one line naming the worker and its signal (it was
    ``worker w1 did not start: ''``)."""
    proc = subprocess.Popen(command(stories, "-n", "4", "--nodes", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not workers_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    first = workers_of(proc.pid)
    assert first, "no worker started"
    os.kill(first[0], signal.SIGKILL)  # it is still importing: seconds from being ready
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.splitlines() == ["mdiedge: error: worker w1 did not start: killed by SIGKILL, "
                                "nothing in its log"], err


def test_a_worker_that_exits_at_start_is_named_with_its_status_and_log() -> None:
    """A worker that cannot start (here: a log level it refuses) gives its exit status and
    the last lines of its log, and the workers started before it are ended."""
    from mdiedge.base.errors import RingError
    from mdiedge.roles.local_ring import LocalRing

    ring = LocalRing(1, log_level="loud")
    with pytest.raises(RingError) as caught:
        with ring:
            pass
    message = str(caught.value)
    assert message.startswith("worker w1 did not start: exit status 2; its log ended: "), message
    assert "--log-level" in message and "'loud'" in message and "\n" not in message
    assert ring.processes == []
