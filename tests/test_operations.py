"""Long-lived processes: workers and a starter serving several generations, status over the
ring, and the authenticated control and data planes."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from mdiedge.base.errors import AuthError, RingError
from mdiedge.runtime.auth import Authenticator
from mdiedge.runtime.control import call, node_id
from mdiedge.base.nodes import NodeSpec
from mdiedge.engine.ring import RingEngine
from commands import MDIEDGE

SECRET = "s3cret-ring-key-0123456789abcdef"


def spawn(args: List[str], secret: str = SECRET) -> Tuple[subprocess.Popen, Dict[str, Any]]:
    env = dict(os.environ, MDIEDGE_SECRET=secret)
    proc = subprocess.Popen([*MDIEDGE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"{args[0]} did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def stories_model(stories: Path) -> Path:
    return stories  # the conftest fixture: tests/data/stories260k, ../shared as a fallback


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: Any, stories_model: Path) -> Iterator[Dict[str, Any]]:
    """Two workers and a starter, as separate long-lived processes."""
    tmp = tmp_path_factory.mktemp("ops")
    workers = [spawn(["worker", "--control-port", "0", "--data-port", "0", "--name", f"w{i + 1}",
                      "--log-level", "warning", "--idle-timeout", "3"]) for i in range(2)]
    ring = tmp / "ring.toml"
    ring.write_text("[starter]\nhost = \"127.0.0.1\"\n" + "".join(
        f"[[workers]]\nname = \"w{i + 1}\"\nhost = \"127.0.0.1\"\ncontrol_port = {info['control_port']}\n"
        for i, (_, info) in enumerate(workers)))
    starter, info = spawn(["starter", "--config", str(ring), "--control-port", "0",
                           "--model", str(stories_model / "stories260K.bin"),
                           "--tokenizer", str(stories_model / "tok512.model"),
                           "--log-level", "warning"])
    yield {"workers": workers, "starter": starter, "url": f"http://127.0.0.1:{info['control_port']}",
           "ring": ring}
    for proc, _ in workers:
        stop(proc)
    stop(starter)


def mdiedge(*args: str, secret: str = SECRET) -> subprocess.CompletedProcess:
    return subprocess.run([*MDIEDGE, *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, MDIEDGE_SECRET=secret))


def test_two_generations_in_a_row_through_one_starter(cluster: Dict[str, Any]) -> None:
    for seed in (1, 2):
        out = mdiedge("generate", "Once upon", "-n", "30", "--seed", str(seed), "--samples", "2",
                      "--starter", cluster["url"], "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["nodes"] == 3 and len(result["samples"]) == 2
        assert all(len(s["token_ids"]) == 30 for s in result["samples"])


def test_second_starter_is_refused_while_the_first_generates(cluster: Dict[str, Any],
                                                              stories_model: Path) -> None:
    auth = Authenticator(SECRET.encode())
    done: List[Any] = []
    body = {"prompt": "", "max_new_tokens": 250, "samples": 4, "micro_batch": 1}
    runner = threading.Thread(target=lambda: done.append(
        call(cluster["url"], "POST", "/generate", body, timeout=120, auth=auth)))
    runner.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nodes = call(cluster["url"], "GET", "/status", auth=auth)["nodes"]
        if nodes[0]["state"] == "busy":
            break
        time.sleep(0.05)
    # first, while the long request surely runs: more samples than the busy ring holds
    with pytest.raises(RingError, match="409.*busy"):
        call(cluster["url"], "POST", "/generate", {"max_new_tokens": 5, "samples": 8}, auth=auth)
    workers = [NodeSpec(f"w{i + 1}", "127.0.0.1", info["control_port"])
               for i, (_, info) in enumerate(cluster["workers"])]
    intruder = RingEngine(workers, stories_model / "stories260K.bin", stories_model / "tok512.model",
                          secret=SECRET.encode())
    with pytest.raises(RingError, match="refused \\(409\\).*serving another starter"):
        intruder.prepare(1, 64)  # the workers' lease holds while their ring is up
    # one that fits waits for a free KV slot (continuous batching) and completes
    small = call(cluster["url"], "POST", "/generate", {"max_new_tokens": 5}, timeout=120, auth=auth)
    assert len(small["samples"][0]["token_ids"]) == 5
    runner.join(120)
    assert done and len(done[0]["samples"]) == 4


def test_status_reports_every_field(cluster: Dict[str, Any]) -> None:
    call(cluster["url"], "POST", "/generate", {"prompt": "", "max_new_tokens": 4},
         timeout=60, auth=Authenticator(SECRET.encode()))  # traffic to report, whatever ran before
    out = mdiedge("status", "--starter", cluster["url"], "--json")
    assert out.returncode == 0, out.stderr
    nodes = json.loads(out.stdout)["nodes"]
    assert [n["role"] for n in nodes] == ["starter", "worker", "worker"]
    fields = ("name", "address", "state", "model", "hash", "layers", "device", "rss_bytes",
              "weight_bytes", "kv_bytes", "slots_in_use", "messages", "tokens", "busy_fraction",
              "link_rtt_ms", "uptime_s", "version", "expert_load")
    for node in nodes:
        missing = [f for f in fields if f not in node]
        assert not missing, (node["name"], missing)
        assert node["state"] in ("idle", "ready", "busy")
    assert nodes[1]["messages"] > 0 and nodes[1]["weight_bytes"] > 0
    table = mdiedge("status", "--ring", str(cluster["ring"]))
    assert table.returncode == 0 and "w2" in table.stdout


@pytest.mark.parametrize("secret,reason", [("wrong-secret-0123456789", "bad signature"),
                                           ("", "unauthenticated")])
def test_control_plane_refuses_wrong_or_missing_secret(cluster: Dict[str, Any], secret: str,
                                                       reason: str) -> None:
    port = cluster["workers"][0][1]["control_port"]
    auth = Authenticator(secret.encode() if secret else None)
    with pytest.raises(RingError, match=f"401.*{reason}"):
        call(f"http://127.0.0.1:{port}", "POST", "/reset", {}, auth=auth)
    out = mdiedge("status", "--starter", cluster["url"], "--json", secret=secret or "x" * 20)
    assert out.returncode == 77  # unauthorized, told apart from a node that is down (69)
    assert json.loads(out.stdout)["unauthorized"] == ["starter"]


def test_replayed_control_request_is_refused(cluster: Dict[str, Any]) -> None:
    port = cluster["workers"][0][1]["control_port"]
    auth = Authenticator(SECRET.encode())
    headers = auth.sign("GET", "/status", b"", node_id(f"http://127.0.0.1:{port}", 5))
    url = f"http://127.0.0.1:{port}/status"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers))
    assert e.value.code == 401 and b"replayed" in e.value.read()


def test_a_request_captured_on_its_way_to_one_node_is_refused_by_another(
        cluster: Dict[str, Any]) -> None:
    """Every control server signs for its own id: what one node took, no other takes."""
    ports = [w[1]["control_port"] for w in cluster["workers"][:2]]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    assert node_id(urls[0], 5) != node_id(urls[1], 5)
    auth = Authenticator(SECRET.encode())
    headers = auth.sign("GET", "/status", b"", node_id(urls[0], 5))
    with urllib.request.urlopen(urllib.request.Request(urls[0] + "/status", headers=headers)) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(urls[1] + "/status", headers=headers))
    assert e.value.code == 401 and b"signed for another node id" in e.value.read()
    assert call(urls[1], "GET", "/status", auth=auth)["name"] == "w2"


@pytest.mark.parametrize("body,headers,code", [
    (b"{not json", {}, 400),
    (b"[1, 2]", {}, 400),
    (json.dumps({"model": 5, "layers": "x"}).encode(), {}, 400),
    (json.dumps({"model": {"hash": "00" * 32, "config": {"model_type": "llama"}}}).encode(), {}, 400),
    (b"x" * 10, {"Content-Length": str(50 << 20)}, 413),
])
def test_fuzzed_control_requests_get_4xx_and_the_node_stays_up(
        cluster: Dict[str, Any], body: bytes, headers: Dict[str, str], code: int) -> None:
    port = cluster["workers"][1][1]["control_port"]
    auth = Authenticator(SECRET.encode())
    signed = dict(auth.sign("POST", "/assign", body, node_id(f"http://127.0.0.1:{port}", 5)),
                  **headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/assign", data=body, headers=signed, method="POST"), timeout=10)
    assert e.value.code == code
    assert call(f"http://127.0.0.1:{port}", "GET", "/status", auth=auth)["name"] == "w2"


def test_data_link_handshake_refuses_a_wrong_secret() -> None:
    good, bad = Authenticator(b"a" * 20), Authenticator(b"b" * 20)
    for acceptor, connector, ok in ((good, good, True), (good, bad, False), (good, Authenticator(None), False)):
        a, c = socket.socketpair()
        errors: List[BaseException] = []

        def accept_side() -> None:
            try:
                acceptor.accept_link(a, "peer", timeout=5)
            except AuthError as e:
                errors.append(e)
                a.close()

        t = threading.Thread(target=accept_side)
        t.start()
        if ok:
            connector.connect_link(c, "acceptor", timeout=5)
        else:
            with pytest.raises(AuthError):
                connector.connect_link(c, "acceptor", timeout=5)
        t.join(5)
        assert bool(errors) != ok
        c.close()


def test_worker_data_port_refuses_an_unauthenticated_peer(cluster: Dict[str, Any]) -> None:
    """A ring is up (a generation runs); a stranger connecting to a worker's data port gets
    dropped at the handshake and the generation is unaffected."""
    data_port = cluster["workers"][0][1]["data_port"]
    with socket.create_connection(("127.0.0.1", data_port), timeout=5) as sock:
        with pytest.raises((AuthError, OSError)):
            Authenticator(b"intruder-secret-123456").connect_link(sock, "w1", timeout=3)


def test_non_loopback_without_secret_is_refused() -> None:
    out = subprocess.run([*MDIEDGE, "worker", "--host", "0.0.0.0",
                          "--control-port", "0", "--data-port", "0"], capture_output=True,
                         text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                     if not k.startswith("MDIEDGE_SECRET")})
    assert out.returncode == 1
    assert "refusing to listen on 0.0.0.0 without a ring secret" in out.stderr


def test_status_exits_69_when_a_worker_is_down(cluster: Dict[str, Any]) -> None:
    proc, _ = cluster["workers"][1]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = mdiedge("status", "--starter", cluster["url"], "--json")
    assert out.returncode == 69
    result = json.loads(out.stdout)
    assert result["down"] == ["w2"]
    assert [n["state"] for n in result["nodes"]][2] == "down"

