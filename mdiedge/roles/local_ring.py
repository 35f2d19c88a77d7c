"""A local ring: worker processes on 127.0.0.1 with free ports, and no orphans.

Each worker binds port 0, reports its ports on its first stdout line and reads the secret from an
inherited pipe (``--secret-fd``: not in argv or environment). It dies with its parent
(``PR_SET_PDEATHSIG``, plus a watchdog on the parent pid), and the launcher terminates, then kills,
every process it started when the block ends, however it ends.

With ``respawn`` (``mdiedge serve``) a dead worker is started again on its control port, as
systemd's ``Restart=``: after ``RESPAWN_FIRST_S``, doubling up to ``RESPAWN_MAX_S`` while restarts
die within ``RESPAWN_STABLE_S``, given up after ``RESPAWN_TRIES`` in a row. The starter takes it
back at the next request."""
from __future__ import annotations

import collections
import ctypes
import json
import os
import select as _select
import signal
import subprocess
import sys
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ..base import defaults, interrupts
from ..base.cpudot import cpu_dot
from ..base.errors import RingError
from ..base.defaults import REAP_INTERVAL_S, RESPAWN_FIRST_S, RESPAWN_MAX_S, RESPAWN_STABLE_S, WORKER_READY_TIMEOUT_S
from ..base.nodes import NodeSpec
from ..base.selfcommand import mdiedge_command

RESPAWN_TRIES = 5  # restarts in a row that died (or did not start) before it is given up
LOG_TAIL_LINES = 3  # lines of a worker's log that the error of a worker that did not start quotes

log = logging.getLogger("mdiedge.local_ring")


def _as_child() -> None:  # runs in the worker between fork and exec
    """A terminal's Ctrl-C reaches the whole process group: a worker ignores it and leaves it to its
    parent, which stops the answer or the ring. On Linux the worker ends with its parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _frozen(pid: int) -> bool:
    """Stopped (SIGSTOP: state T in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def restart_pause(tries: int, lived_s: float) -> Tuple[int, Optional[float]]:
    """(restarts in a row, reset by one living ``RESPAWN_STABLE_S``; pause before the next, None:
    given up)."""
    if lived_s >= RESPAWN_STABLE_S:
        tries = 0
    if tries >= RESPAWN_TRIES:
        return tries, None
    return tries, min(RESPAWN_MAX_S, RESPAWN_FIRST_S * 2 ** tries)


class LocalRing:
    """``with LocalRing(2) as workers:`` starts two workers and yields their addresses; ``spares``
    more after them; ``encrypt`` False: ``--no-encrypt`` (measurements only); ``respawn``: see the
    module docstring."""

    def __init__(self, n_workers: int, threads: int = 1, log_level: str = "warning",
                 cache_dir: Optional[str] = None, device: str = "cpu", spares: int = 0,
                 busy_poll_us: int = defaults.BUSY_POLL_US, encrypt: bool = True,
                 respawn: bool = False) -> None:
        self.n_workers, self.threads, self.log_level = n_workers, threads, log_level
        self.encrypt = encrypt
        self.busy_poll_us = busy_poll_us
        self.spares = spares
        self.device = device  # where every worker computes
        self.cache_dir = cache_dir
        self.processes: List[subprocess.Popen] = []
        self.workers: List[NodeSpec] = []
        self.secret = os.urandom(32).hex().encode()  # this ring's own; passed on a pipe
        self.respawn = respawn
        self._started: List[float] = []  # when each worker's process was started
        self._restarts: Dict[int, Tuple[int, Optional[float]]] = {}  # index: tries, due at
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # a restart and stop, one at a time
        self._logs: Dict[int, _LogTail] = {}  # by pid: each worker's log, passed on

    def __enter__(self) -> List[NodeSpec]:
        try:
            for i in range(self.n_workers):
                self._add(f"w{i + 1}")
            for i in range(self.spares):
                self._add(f"spare{i + 1}", spare=True)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._reap, name="local-ring-reaper", daemon=True).start()
        return self.workers

    def _add(self, name: str, spare: bool = False) -> None:
        with self._lock:
            proc, spec = self._spawn(name, 0, spare)
            self.processes.append(proc)
            self.workers.append(spec)
            self._started.append(time.monotonic())

    def _reap(self) -> None:
        """Collect a dead worker (no zombie); with ``respawn`` restart it once its pause has passed.
        """
        while not self._stopped.wait(REAP_INTERVAL_S):
            for i, proc in enumerate(list(self.processes)):
                if proc.poll() is not None and self.respawn:
                    self._restart(i, proc.returncode)

    def _restart(self, i: int, code: int) -> None:
        now, name = time.monotonic(), self.workers[i].name
        tries, due = self._restarts.get(i, (0, None))
        if due is None:  # seen dead now: when to start it again
            tries, pause = restart_pause(tries, now - self._started[i])
            if pause is None:
                log.error("%s died (exit %s) after %d restarts in a row; not started again",
                          name, code, tries)
            self._restarts[i] = (tries, now + pause if pause is not None else float("inf"))
            return
        if now < due:
            return
        self._restarts[i] = (tries + 1, None)
        with self._lock:
            if self._stopped.is_set():
                return
            self._started[i] = now  # a start that fails counts as a restart that died
            try:
                proc, _ = self._spawn(name, self.workers[i].control_port, self.workers[i].spare)
            except RingError as e:
                log.warning("%s: starting it again failed: %s", name, e)
                return
            _close_stdout(self.processes[i])
            self._logs.pop(self.processes[i].pid, None)
            self.processes[i], self._started[i] = proc, time.monotonic()
        log.warning("%s died (exit %s); started again on control port %d", name, code,
                    self.workers[i].control_port)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, control_port: int, spare: bool) -> Tuple[subprocess.Popen,
                                                                          NodeSpec]:
        """Ready, with its address (``control_port`` 0: a free one); RingError when it does not
        start."""
        cmd = mdiedge_command(["worker", "--host", "127.0.0.1",
               "--control-port", str(control_port), "--data-port", "0",
               "--threads", str(self.threads), "--name", name, "--log-level", self.log_level,
               "--parent-pid", str(os.getpid()), "--busy-poll-us", str(self.busy_poll_us),
               "--cpu-dot", cpu_dot(), "--no-config"])
        if self.cache_dir:
            cmd += ["--cache-dir", self.cache_dir]
        if not self.encrypt:
            cmd += ["--no-encrypt"]
        proc = self._popen(cmd)
        try:
            line = self._ready_line(proc, name)
            ready = json.loads(line)
            return proc, NodeSpec(name, "127.0.0.1", int(ready["control_port"]),
                                  device=self.device, spare=spare)
        except (ValueError, KeyError):
            _end(proc)
            raise RingError(f"worker {name} did not start: it said {line.strip()!r}; "
                            f"{_ending(proc, self._logs.get(proc.pid))}") from None
        except BaseException:
            _end(proc)
            raise

    def _popen(self, cmd: List[str]) -> subprocess.Popen:
        preexec = _as_child if os.name == "posix" else None
        env = {k: v for k, v in os.environ.items()
               if k not in ("MDIEDGE_SECRET", "MDIEDGE_SECRET_FILE")}
        read_end, write_end = os.pipe()  # the secret: neither in argv nor in the environment
        try:
            os.write(write_end, self.secret)  # 64 bytes: within any pipe's buffer
            os.close(write_end)
            write_end = -1
            proc = self._fork(cmd + ["--secret-fd", str(read_end)], preexec, env, read_end)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        self._logs[proc.pid] = _LogTail(proc)
        return proc

    @staticmethod
    def _fork(cmd: List[str], preexec: Any, env: Dict[str, str], fd: int) -> subprocess.Popen:
        """The worker started with Ctrl-C held: one pressed while the parent runs its at-fork
        handlers (logging's) would be lost there ("Exception ignored"); it is raised after,
        the worker ended first."""
        proc = None
        try:
            with interrupts.held():
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, preexec_fn=preexec, env=env,
                                        pass_fds=(fd,))
        except KeyboardInterrupt:
            if proc is not None:
                _end(proc)
            raise
        return proc

    def _ready_line(self, proc: subprocess.Popen, name: str) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            readable, _, _ = _select.select([proc.stdout], [], [], 0.2)
            line = proc.stdout.readline().decode(errors="replace") if readable else ""
            if line:
                return line
            if readable or proc.poll() is not None:  # its stdout ended: so did it
                _end(proc)
                raise RingError(f"worker {name} did not start: "
                                f"{_ending(proc, self._logs.get(proc.pid))}")
        raise RingError(f"worker {name} was not ready within {WORKER_READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:  # after a restart under way
            processes, self.processes = self.processes, []
        for proc in processes:
            if proc.poll() is None:
                if _frozen(proc.pid):  # SIGSTOPped: it cannot act on a SIGTERM
                    proc.kill()
                else:
                    proc.terminate()
        deadline = time.monotonic() + 5
        for proc in processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _close_stdout(proc)
            log_tail = self._logs.pop(proc.pid, None)
            if log_tail is not None:  # its last lines passed on before this process ends
                log_tail.thread.join(0.5)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    _close_stdout(proc)


def _close_stdout(proc: subprocess.Popen) -> None:
    if proc.stdout is not None:
        proc.stdout.close()


def _ending(proc: subprocess.Popen, log_tail: Optional[_LogTail]) -> str:
    """How it ended and its log's last lines, in one line."""
    code = proc.returncode
    if code is not None and code < 0:
        try:
            status = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            status = f"killed by signal {-code}"
    else:
        status = f"exit status {code}"
    lines = log_tail.last() if log_tail is not None else []
    if not lines:
        return f"{status}, nothing in its log"
    return f"{status}; its log ended: " + " | ".join(repr(line) for line in lines)


class _LogTail:
    """A worker's stderr passed on as it comes, its last lines kept for a failed start's error."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: collections.deque = collections.deque(maxlen=LOG_TAIL_LINES)
        self.thread = threading.Thread(target=self._pass_on, args=(proc.stderr,),
                                       name="local-ring-log", daemon=True)

        self.thread.start()

    def last(self) -> List[str]:
        """Read to its end, within a second."""
        self.thread.join(1.0)
        return list(self.lines)

    def _pass_on(self, stream: object) -> None:
        try:
            for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
                _write_stderr(raw)
                text = raw.decode(errors="replace").strip()
                if text:
                    self.lines.append(text[:300])
        except (OSError, ValueError):  # closed under us
            pass
        finally:
            stream.close()  # type: ignore[attr-defined]


def _write_stderr(data: bytes) -> None:
    """Onto descriptor 2 (where a worker's log went before it was piped); a closed one drops it."""
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass
