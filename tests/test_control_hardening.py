"""The HTTP control plane against hostile or broken peers, over real sockets: authentication
before any body is read, bounded connections with a socket timeout, no request desync, no
handler thread killed by a malformed request, 502 for a dead downstream node, and ``call``
turning every answer into a one-line ``RingError``."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any, Dict, Iterator

import pytest

from mdiedge.base.errors import ConfigError, Conflict, RingError
from mdiedge.base.memory import rss_bytes
from mdiedge.runtime import auth as auth_module
from mdiedge.runtime.auth import Authenticator, is_loopback
from mdiedge.runtime.control import ControlServer, call

SECRET = b"hardening-secret-0123456789abcdef"
MiB = 1 << 20


def _echo(body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
    return {"body": body, "raw_bytes": len(raw)}


def _raises(error: BaseException) -> Any:
    def handler(body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        raise error
    return handler


ROUTES = {("POST", "/echo"): _echo, ("GET", "/status"): _echo,
          ("PUT", "/weights"): _echo,
          ("POST", "/ring"): _raises(RingError("w2 (127.0.0.1:1) is unreachable: refused")),
          ("POST", "/conflict"): _raises(Conflict("busy with another starter")),
          ("POST", "/config"): _raises(ConfigError("bad hidden_size 'x'")),
          ("POST", "/value"): _raises(ValueError("bad value 3"))}


@pytest.fixture
def server() -> Iterator[ControlServer]:
    control = ControlServer("127.0.0.1", 0, ROUTES, raw_routes={"/weights": lambda: 64 << 30},
                            auth=Authenticator(SECRET))
    control.timeout_s = 0.5
    control.start()
    yield control
    control.stop()


def connect(control: ControlServer, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", control.port), timeout=timeout)


def head(method: str, path: str, headers: Dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def read_all(sock: socket.socket, timeout: float = 2.0) -> bytes:
    """Everything the server sends until it closes, or until ``timeout`` of silence."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except socket.timeout:
        return data + b"<still open>"
    except ConnectionResetError:
        return data + b"<reset>"


def exchange(control: ControlServer, data: bytes, timeout: float = 2.0) -> bytes:
    with connect(control) as sock:
        sock.sendall(data)
        return read_all(sock, timeout)


def signed(method: str, path: str, body: bytes, server: ControlServer) -> Dict[str, str]:
    """Headers of a genuine request for ``server`` (signed for its node id)."""
    return dict(Authenticator(SECRET).sign(method, path, body, server.auth.node),
                **{"Content-Length": str(len(body))})


def no_tracebacks(caplog: Any, capfd: Any) -> None:
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert "Traceback" not in capfd.readouterr().err


# ------------------------------------------------------------- finding 1: unauthenticated memory

def test_unauthenticated_put_with_a_huge_length_is_refused_unread(server: ControlServer,
                                                                  caplog: Any, capfd: Any) -> None:
    caplog.set_level(logging.DEBUG, "mdiedge")
    t0 = time.monotonic()
    reply = exchange(server, head("PUT", "/weights", {"Content-Length": str(20 << 30)}), timeout=3)
    assert reply.startswith(b"HTTP/1.1 401") and b"unauthenticated" in reply, reply[:200]
    assert reply.endswith(b"}"), "the connection must close: its body was not read"
    assert time.monotonic() - t0 < 2.5
    no_tracebacks(caplog, capfd)


def test_a_flood_of_unauthenticated_large_bodies_does_not_grow_memory(server: ControlServer) -> None:
    """Each connection sends all but the last byte of a 1 MiB body and stalls: a server that
    reads bodies before checking the signature would hold 1 MiB per connection."""
    body = memoryview(b"x" * MiB)[:-1]
    before, held = rss_bytes(), []
    for _ in range(120):
        sock = connect(server, timeout=2)
        held.append(sock)
        try:
            sock.sendall(head("POST", "/echo", {"Content-Length": str(MiB)}))
            sock.sendall(body)
        except OSError:  # refused and closed before the body: what we want
            pass
    time.sleep(0.3)
    growth = rss_bytes() - before
    for sock in held:
        sock.close()
    assert growth < 24 * MiB, f"RSS grew by {growth / MiB:.0f} MiB"


def test_silent_connections_are_dropped_and_do_not_block_a_signed_request(
        server: ControlServer, caplog: Any, capfd: Any) -> None:
    """More silent connections than the cap: the oldest unauthenticated ones make room."""
    silent = [connect(server) for _ in range(server.max_connections + 36)]
    t0 = time.monotonic()
    assert call(server.url, "GET", "/status", auth=Authenticator(SECRET), timeout=5)["raw_bytes"] == 0
    assert time.monotonic() - t0 < 1.0
    ends = [read_all(sock, timeout=3) for sock in silent]  # the server times them out
    assert all(not end.endswith(b"<still open>") for end in ends), ends[:3]
    for sock in silent:
        sock.close()
    no_tracebacks(caplog, capfd)


def test_connections_beyond_the_cap_are_refused_quickly(server: ControlServer) -> None:
    """Every slot serves an authenticated request: a new connection gets a 503 at once."""
    server.max_connections = 4
    release, entered = threading.Event(), threading.Semaphore(0)

    def block(body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        entered.release()
        release.wait(10)
        return {}
    server.routes[("POST", "/block")] = block
    callers = [threading.Thread(target=call, args=(server.url, "POST", "/block", {}),
                                kwargs={"auth": Authenticator(SECRET)}) for _ in range(4)]
    for caller in callers:
        caller.start()
    for _ in callers:
        assert entered.acquire(timeout=5)
    threads = threading.active_count()
    t0 = time.monotonic()
    reply = exchange(server, head("GET", "/ping", {}), timeout=1)
    assert reply.startswith(b"HTTP/1.1 503"), reply[:100]
    assert time.monotonic() - t0 < 0.5 and threading.active_count() <= threads
    release.set()
    for caller in callers:
        caller.join(5)
    assert exchange(server, head("GET", "/ping", {})).startswith(b"HTTP/1.1 200")


def test_a_peer_aborting_or_stalling_mid_body_logs_no_traceback(server: ControlServer,
                                                                 caplog: Any, capfd: Any) -> None:
    caplog.set_level(logging.DEBUG, "mdiedge")
    body = json.dumps({"a": "b" * 1000}).encode()
    request = head("POST", "/echo", signed("POST", "/echo", body, server)) + body[:10]
    with connect(server) as sock:  # aborts
        sock.sendall(request)
    with connect(server) as sock:  # stalls: the server drops it after its timeout
        sock.sendall(request)
        assert not read_all(sock, timeout=3).endswith(b"<still open>")
    time.sleep(0.2)
    assert call(server.url, "POST", "/echo", {"x": 1}, auth=Authenticator(SECRET))["body"] == {"x": 1}
    no_tracebacks(caplog, capfd)


def test_body_digest_binds_the_body_and_a_nonce_is_burnt_only_when_verified(
        server: ControlServer) -> None:
    good, evil = b'{"a": 1}', b'{"a": 2}'
    headers = signed("POST", "/echo", good, server)
    assert exchange(server, head("POST", "/echo", headers) + evil).startswith(b"HTTP/1.1 401")
    reply = exchange(server, head("POST", "/echo", headers) + good)  # the genuine one still passes
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    replay = exchange(server, head("POST", "/echo", headers) + good)
    assert replay.startswith(b"HTTP/1.1 401") and b"replayed" in replay


def test_a_signed_raw_body_is_served(server: ControlServer) -> None:
    raw = bytes(range(256)) * 4096
    reply = call(server.url, "PUT", "/weights?hash=ab", raw=raw, auth=Authenticator(SECRET))
    assert reply["raw_bytes"] == len(raw)


# ------------------------------------------------------------- finding 2: smaller findings

HIDDEN = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.mark.parametrize("method,path,headers", [
    ("POST", "/nowhere", {"Content-Length": str(len(HIDDEN))}),                    # 404
    ("GET", "/echo", {"Content-Length": str(len(HIDDEN))}),                        # 405
    ("POST", "/echo", {"Content-Length": "12abc"}),                                # bad length
    ("POST", "/echo", {"Transfer-Encoding": "chunked"}),                           # not supported
    ("POST", "/echo", {"Content-Length": str(len(HIDDEN))}),                       # 401, unread
])
def test_an_unread_body_closes_the_connection_instead_of_serving_what_it_hides(
        server: ControlServer, method: str, path: str, headers: Dict[str, str]) -> None:
    reply = exchange(server, head(method, path, headers) + HIDDEN)
    assert reply.count(b"HTTP/1.1 ") == 1 and b"pong" not in reply, reply
    assert not reply.endswith(b"<still open>")


@pytest.mark.parametrize("clock", [float("nan"), float("inf")])
def test_a_non_finite_timestamp_is_stale(server: ControlServer, monkeypatch: Any,
                                         clock: float) -> None:
    monkeypatch.setattr(auth_module.time, "time", lambda: clock)
    headers = signed("GET", "/status", b"", server)
    monkeypatch.undo()
    reply = exchange(server, head("GET", "/status", headers))
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


def test_a_non_ascii_mac_gets_401(server: ControlServer) -> None:
    headers = signed("GET", "/status", b"", server)
    headers[auth_module.HEADER_MAC] = "\xe9" * 64
    reply = exchange(server, head("GET", "/status", headers))
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


def test_deeply_nested_json_gets_400(server: ControlServer, caplog: Any, capfd: Any) -> None:
    body = b"[" * 200000
    reply = exchange(server, head("POST", "/echo", signed("POST", "/echo", body, server)) + body)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    no_tracebacks(caplog, capfd)


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.5.6.7", True), ("::1", True), ("localhost", True),
    ("LOCALHOST", True), ("127.attacker.example", False), ("127.0.0.1.nip.io", False),
    ("10.0.0.1", False), ("0.0.0.0", False), ("", False)])
def test_is_loopback_means_a_literal_loopback_address(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("path,code", [("/ring", 502), ("/conflict", 409), ("/config", 400),
                                       ("/value", 400)])
def test_handler_errors_map_to_status_codes(server: ControlServer, path: str, code: int) -> None:
    with pytest.raises(RingError) as e:
        call(server.url, "POST", path, {}, node="w1", auth=Authenticator(SECRET))
    assert getattr(e.value, "status", None) == code
    assert f"({code})" in str(e.value) and str(e.value).startswith("w1 (")


CANNED = [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnot j",
          b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n[1, 2]",
          b"HTTP/1.1 500 Oops\r\nContent-Length: 25\r\n\r\n{\"error\": \"line1\\nline2\"}",
          b"HTTP/1.1 503 Busy\r\nContent-Length: 9\r\n\r\n<b>no</b>",
          b"HTTP/1.1 502 Bad\r\nContent-Length: 6\r\n\r\n[\"x\"]\n",
          b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"short\"",
          b"garbage\r\n\r\n",
          b""]


@pytest.mark.parametrize("answer", CANNED)
def test_call_turns_every_answer_into_a_one_line_ring_error(answer: bytes) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(2)
            try:
                conn.recv(65536)
                conn.sendall(answer)
            except OSError:
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(RingError) as e:
        call(url, "POST", "/x", {}, node="w9", timeout=3)
    assert str(e.value).startswith("w9 (") and "\n" not in str(e.value), str(e.value)
    thread.join(3)
    listener.close()


def test_public_ping_needs_no_signature_and_takes_no_body(server: ControlServer) -> None:
    assert exchange(server, head("GET", "/ping", {})).startswith(b"HTTP/1.1 200")
    reply = exchange(server, head("GET", "/ping", {"Content-Length": "5"}) + b"hello")
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]


# ------------------------------------------------------------- one captured request, one slot

def test_a_nonce_in_flight_is_a_replay_until_released_or_accepted() -> None:
    auth, body = Authenticator(SECRET), b'{"a": 1}'
    headers = auth.sign("POST", "/echo", body)
    assert auth.check_headers("POST", "/echo", headers) is None
    assert auth.check_headers("POST", "/echo", headers) == "replayed request"  # in flight
    auth.release(headers)  # its body never came: a genuine sender may still use it
    assert auth.check_headers("POST", "/echo", headers) is None
    assert auth.accept(headers, "0" * 64).startswith("body does not match")  # released too
    assert auth.check(  # the genuine body after a forged one
        "POST", "/echo", body, headers) is None
    assert auth.check_headers("POST", "/echo", headers) == "replayed request"


def test_captured_headers_hold_one_connection_and_a_trickled_body_is_dropped(
        server: ControlServer, monkeypatch: Any) -> None:
    monkeypatch.setattr("mdiedge.runtime.control.CONTROL_MIN_BODY_RATE", 1 << 30)
    server.timeout_s = 1.0  # a body must come within a second, whatever its pace
    body = b'{"a": "' + b"x" * 1000 + b'"}'
    request = head("POST", "/echo", signed("POST", "/echo", body, server))
    with connect(server) as first, connect(server) as second:
        first.sendall(request + body[:1])
        time.sleep(0.2)
        second.sendall(request + body[:1])  # the same captured headers again
        replay = read_all(second, timeout=3)
        assert replay.startswith(b"HTTP/1.1 401") and b"replayed" in replay
        started = time.monotonic()
        for i in range(1, 40):  # a byte every 0.1 s: each read well within the timeout
            try:
                first.sendall(body[i:i + 1])
            except OSError:
                break
            time.sleep(0.1)
        assert not read_all(first, timeout=3).endswith(b"<still open>")
        assert time.monotonic() - started < 3.5
    assert call(server.url, "POST", "/echo", {"x": 1}, auth=Authenticator(SECRET))["body"] == {"x": 1}


def test_a_client_signing_for_an_old_node_id_asks_again_once(server: ControlServer,
                                                            monkeypatch: Any) -> None:
    """As after the node restarted: the first request is refused, the id asked again, and
    the request signed for the new id is served; a wrong secret still fails."""
    from mdiedge.runtime import control as control_module

    monkeypatch.setitem(control_module._NODE_IDS, server.url, "an-old-id")
    assert call(server.url, "POST", "/echo", {"x": 1}, auth=Authenticator(SECRET))["body"] == {"x": 1}
    assert control_module._NODE_IDS[server.url] == server.auth.node
    with pytest.raises(RingError, match="401"):
        call(server.url, "POST", "/echo", {"x": 1}, auth=Authenticator(b"another-secret-0123456789"))


def test_a_request_for_an_old_node_id_is_not_called_a_wrong_secret(server: ControlServer,
                                                                   monkeypatch: Any,
                                                                   caplog: Any) -> None:
    """A node that restarted (a new id) tells a request signed with the right secret for its
    old id, logged as routine (info), from a wrong secret (a warning); the client says it
    asked the new id and sent again."""
    from mdiedge.runtime import control as control_module

    caplog.set_level(logging.INFO, "mdiedge")
    monkeypatch.setitem(control_module._NODE_IDS, server.url, "0123456789abcdef" * 2)
    call(server.url, "POST", "/echo", {"x": 1}, node="w1", auth=Authenticator(SECRET))
    refusal = [r for r in caplog.records if r.getMessage().startswith("refused POST /echo")]
    assert len(refusal) == 1 and refusal[0].levelno == logging.INFO
    assert "another node id (01234567..." in refusal[0].getMessage()
    assert "wrong ring secret" not in refusal[0].getMessage()
    assert any("w1 (" in r.getMessage() and "node id changed" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    wrong = Authenticator(b"another-secret-0123456789")
    with pytest.raises(RingError, match="wrong ring secret"):
        call(server.url, "POST", "/echo", {"x": 1}, auth=wrong)
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("refused")] == \
        [logging.WARNING]


def test_the_node_id_claimed_by_a_signature_is_checked_under_the_secret() -> None:
    """A forged X-Mdiedge-Node under a wrong secret is still a wrong secret, and a genuine
    signature for another node is not accepted by this one."""
    node = Authenticator(SECRET).for_node("ab" * 16)
    genuine = Authenticator(SECRET).sign("GET", "/status", b"", "cd" * 16)
    refused = node.check_headers("GET", "/status", genuine)
    assert refused is not None and refused.startswith(auth_module.NODE_CHANGED)
    forged = Authenticator(b"wrong-secret-0123456789abcdef").sign("GET", "/status", b"", "cd" * 16)
    assert node.check_headers("GET", "/status", forged) == "bad signature (wrong ring secret)"
    lying = dict(genuine, **{auth_module.HEADER_NODE: "ab" * 16})
    assert node.check_headers("GET", "/status", lying) == "bad signature (wrong ring secret)"
