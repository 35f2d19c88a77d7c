"""A command's process ends without the interpreter's teardown (``mdiedge.base.leave``), yet
as ``SystemExit`` would end it; a control server stops within a poll of its loop."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mdiedge.base.leave import exit_status

PROGRAM = """
import atexit, sys, threading, time
from mdiedge.base.leave import leave
atexit.register(lambda: print("atexit ran", flush=False))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", end="; "))).start()
from concurrent.futures import ThreadPoolExecutor
ThreadPoolExecutor(1).submit(print, "pool ran", end="; ").result()  # idle, not shut down
print("buffered", end="; ")
leave(%s)
"""


@pytest.mark.parametrize("code, status", [(None, 0), (0, 0), (3, 3), (130, 130), (256, 0),
                                          (True, 1), ("a message", 1)])
def test_exit_status_is_systemexits(code: object, status: int) -> None:
    assert exit_status(code) == status


@pytest.mark.parametrize("code, status", [("3", 3), ("None", 0), ("'no model'", 1)])
def test_leave_ends_pools_waits_for_threads_runs_atexit_and_flushes(code: str,
                                                                    status: int) -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM % code], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == status
    assert out.stdout == "pool ran; buffered; thread done; atexit ran\n"
    assert out.stderr == ("no model\n" if status == 1 else "")


def test_a_control_server_stops_within_a_poll() -> None:
    from mdiedge.runtime.control import ControlServer

    server = ControlServer("127.0.0.1", 0, {}).start()
    time.sleep(0.1)  # its loop is waiting for a connection
    began = time.monotonic()
    server.stop()
    assert time.monotonic() - began < 0.3  # up to 0.5 s before


@pytest.mark.parametrize("code, status", [("0", 120), ("3", 3)])
def test_output_that_cannot_be_written_is_a_failure(code: str, status: int) -> None:
    """stdout that cannot take the rest of the answer (a full disk): a status 0 becomes
    Python's own 120, another status stays."""
    program = ("import sys\nfrom mdiedge.base.leave import leave\n"
               "class Full:\n"
               "    def write(self, text): return len(text)\n"
               "    def flush(self): raise OSError(28, 'No space left on device')\n"
               "sys.stdout = Full()\nleave(%s)\n" % code)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == status, out.stderr


def test_a_ctrl_c_while_leaving_is_status_130() -> None:
    program = ("import os, signal, threading, time\n"
               "from mdiedge.base.leave import leave\n"
               "threading.Thread(target=lambda: (time.sleep(0.5), os.kill(os.getpid(),"
               " signal.SIGINT), time.sleep(5))).start()\n"
               "leave(0)\n")
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr
    assert time.monotonic() - began < 4
