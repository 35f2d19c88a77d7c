"""Instant restart: ``mdiedge starter`` killed with SIGKILL and started again on its control
port takes its workers back at once (a signed takeover by the same ring secret and starter
name; the workers end the old session's ring) and serves within 5 s, instead of being refused
("w1 is serving another starter") until the workers' ``idle_timeout_s`` passes. Another
starter (another name) is still refused. Real processes on loopback."""
from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.base.errors import RingError
from mdiedge.runtime.auth import Authenticator
from mdiedge.runtime.control import call
from test_operations import SECRET, spawn, stop

SERVE_WITHIN_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def generate(port: int) -> Dict[str, Any]:
    return call(f"http://127.0.0.1:{port}", "POST", "/generate",
                {"prompt": "Once", "max_new_tokens": 20, "temperature": 0.0}, timeout=120,
                node="starter", auth=Authenticator(SECRET.encode()))


def test_a_restarted_starter_serves_at_once_and_another_is_refused(stories: Path,
                                                                   tmp_path: Path) -> None:
    workers = [spawn(["worker", "--control-port", "0", "--data-port", "0", "--name", f"w{i}",
                      "--log-level", "warning"]) for i in (1, 2)]
    ring = tmp_path / "ring.toml"
    ring.write_text("[starter]\nstall_s = 2\n" + "".join(
        f'[[workers]]\nname = "w{i + 1}"\nhost = "127.0.0.1"\ncontrol_port = '
        f'{info["control_port"]}\n' for i, (_, info) in enumerate(workers)))
    model = ["--model", str(stories / "stories260K.bin"), "--tokenizer",
             str(stories / "tok512.model"), "--log-level", "warning"]
    port = free_port()

    def starter(at: int) -> Any:
        return spawn(["starter", "--config", str(ring), "--control-port", str(at)] + model)[0]

    procs: List[Any] = [starter(port)]
    try:
        want = generate(port)["samples"][0]["token_ids"]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        procs[0] = starter(port)
        started = time.monotonic()
        again = generate(port)["samples"][0]["token_ids"]
        served_s = time.monotonic() - started
        assert again == want
        assert served_s < SERVE_WITHIN_S, f"served {served_s:.1f} s after the restart"
        other = free_port()
        procs.append(starter(other))
        with pytest.raises(RingError, match="w1 is serving another starter"):
            generate(other)
        assert generate(port)["samples"][0]["token_ids"] == want  # the owner was left alone
    finally:
        for proc in procs + [w for w, _ in workers]:
            stop(proc)


@pytest.mark.parametrize("secret, name, takes_over", [
    (SECRET.encode(), "host http://10.0.0.1:7600", True),   # the same starter, restarted
    (SECRET.encode(), "host http://10.0.0.1:7601", False),  # another starter
    (SECRET.encode(), "", False),                           # one that names none (generate)
    (None, "host http://10.0.0.1:7600", False),             # unsigned: no takeover
])
def test_who_may_take_a_worker_over(secret: Any, name: str, takes_over: bool) -> None:
    from mdiedge.roles.worker import WorkerNode
    from mdiedge.base.errors import Conflict

    worker = WorkerNode(secret=secret, name="w1").start()
    try:
        worker.reset({"session": "old", "starter": "host http://10.0.0.1:7600"}, b"", {})
        if takes_over:
            worker.reset({"session": "new", "starter": name}, b"", {})
            assert worker.owner == "new"
        else:
            with pytest.raises(Conflict, match="w1 is serving another starter"):
                worker.reset({"session": "new", "starter": name}, b"", {})
            assert worker.owner == "old"
    finally:
        worker.stopped.set()
        worker.close()
