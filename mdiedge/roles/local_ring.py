"""A local ring: worker processes on 127.0.0.1 with free ports, and no orphans.

Each worker binds port 0 and reports its ports on its first stdout line; it reads the ring's
secret from an inherited pipe (``--secret-fd``), so the secret is in neither its command line
nor its environment (``ps e``, ``/proc/PID/environ``). It dies with its parent
(``PR_SET_PDEATHSIG`` on Linux, plus a watchdog on the parent pid), and the launcher
terminates (or, if it is stopped, kills at once), then kills, every process it started when
the block ends, however it ends.
"""
from __future__ import annotations

import ctypes
import json
import os
import select as _select
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

from ..base import defaults
from ..base.errors import RingError
from ..base.nodes import NodeSpec

READY_TIMEOUT_S = 60.0
REAP_INTERVAL_S = 1.0


def threads_per_node(n_nodes: int) -> int:
    """Divide the machine's cores among the nodes of a local ring."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // n_nodes)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _frozen(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, state T in /proc on Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class LocalRing:
    """``with LocalRing(2) as workers:`` starts two workers and yields their addresses;
    ``spares`` more are started as spares (``NodeSpec.spare``), after them in the list;
    ``busy_poll_us`` is each worker's ``--busy-poll-us``; ``encrypt`` False gives each
    ``--no-encrypt`` (its starter must run without sealing too: measurements only)."""

    def __init__(self, n_workers: int, threads: int = 1, log_level: str = "warning",
                 cache_dir: Optional[str] = None, device: str = "cpu", spares: int = 0,
                 busy_poll_us: int = defaults.BUSY_POLL_US, encrypt: bool = True) -> None:
        self.n_workers, self.threads, self.log_level = n_workers, threads, log_level
        self.encrypt = encrypt
        self.busy_poll_us = busy_poll_us
        self.spares = spares
        self.device = device  # where every worker computes
        self.cache_dir = cache_dir
        self.processes: List[subprocess.Popen] = []
        self.workers: List[NodeSpec] = []
        self.secret = os.urandom(32).hex().encode()  # this ring's own; passed on a pipe
        self._stopped = threading.Event()

    def __enter__(self) -> List[NodeSpec]:
        try:
            for i in range(self.n_workers):
                self._spawn(f"w{i + 1}")
            for i in range(self.spares):
                self._spawn(f"spare{i + 1}", spare=True)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._reap, name="local-ring-reaper", daemon=True).start()
        return self.workers

    def _reap(self) -> None:
        """Collect a worker that died while the ring runs, so it lingers as no zombie."""
        while not self._stopped.wait(REAP_INTERVAL_S):
            for proc in list(self.processes):
                proc.poll()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, spare: bool = False) -> None:
        cmd = [sys.executable, "-m", "mdiedge", "worker", "--host", "127.0.0.1",
               "--control-port", "0", "--data-port", "0", "--threads", str(self.threads),
               "--name", name, "--log-level", self.log_level, "--parent-pid", str(os.getpid()),
               "--busy-poll-us", str(self.busy_poll_us), "--no-config"]
        if self.cache_dir:
            cmd += ["--cache-dir", self.cache_dir]
        if not self.encrypt:
            cmd += ["--no-encrypt"]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        env = {k: v for k, v in os.environ.items()
               if k not in ("MDIEDGE_SECRET", "MDIEDGE_SECRET_FILE")}
        read_end, write_end = os.pipe()  # the secret: neither in argv nor in the environment
        try:
            os.write(write_end, self.secret)  # 64 bytes: within any pipe's buffer
            os.close(write_end)
            write_end = -1
            proc = subprocess.Popen(cmd + ["--secret-fd", str(read_end)], stdout=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, preexec_fn=preexec, env=env,
                                    pass_fds=(read_end,))
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        self.processes.append(proc)
        line = self._ready_line(proc, name)
        try:
            ready = json.loads(line)
            self.workers.append(NodeSpec(name, "127.0.0.1", int(ready["control_port"]),
                                        device=self.device, spare=spare))
        except (ValueError, KeyError):
            raise RingError(f"worker {name} did not start: {line.strip()!r}") from None

    def _ready_line(self, proc: subprocess.Popen, name: str) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            readable, _, _ = _select.select([proc.stdout], [], [], 0.2)
            if readable:
                return proc.stdout.readline().decode(errors="replace")
            if proc.poll() is not None:
                raise RingError(f"worker {name} exited with code {proc.returncode} before it was ready")
        raise RingError(f"worker {name} was not ready within {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self._stopped.set()
        for proc in self.processes:
            if proc.poll() is None:
                if _frozen(proc.pid):  # SIGSTOPped: it cannot act on a SIGTERM
                    proc.kill()
                else:
                    proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.processes = []
