"""Signed control replies, over real sockets: a node signs its reply to every authenticated
request (bound to that request's nonce) and ``call`` refuses a successful reply whose
signature is missing, altered by a proxy on the way, or replayed from an earlier request."""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable, Dict, Iterator, List

import pytest

from mdiedge.base.errors import RingError
from mdiedge.runtime.auth import HEADER_REPLY, Authenticator
from mdiedge.runtime.control import ControlServer, call

SECRET = b"signed-replies-secret-0123456789"


def _status(body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
    return {"state": "ready", "text": "the generated text"}


@pytest.fixture
def server() -> Iterator[ControlServer]:
    control = ControlServer("127.0.0.1", 0, {("GET", "/status"): _status,
                                             ("POST", "/status"): _status},
                            auth=Authenticator(SECRET))
    control.start()
    yield control
    control.stop()


def _request(client: socket.socket) -> bytes:
    """One whole request from ``client``: its headers, then its Content-Length of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = client.recv(1 << 16)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = client.recv(length - len(body))
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class ReplyProxy:
    """A TCP proxy in front of ``port`` that passes requests as they are and hands each
    reply (up to its end: the connection is closed after it) to ``rewrite``."""

    def __init__(self, port: int, rewrite: Callable[[bytes], bytes]) -> None:
        self.port, self.rewrite = port, rewrite
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.replies: List[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.port)) as server:
            server.sendall(_request(client))
            reply = b""
            while True:
                chunk = server.recv(1 << 16)
                if not chunk:
                    break
                reply += chunk
            self.replies.append(reply)
            client.sendall(self.rewrite(reply))

    def close(self) -> None:
        self.listener.close()


def test_a_reply_is_signed_and_checked(server: ControlServer) -> None:
    auth = Authenticator(SECRET)
    assert call(server.url, "GET", "/status", auth=auth) == {"state": "ready",
                                                             "text": "the generated text"}


@pytest.mark.parametrize("rewrite, why", [
    (lambda reply: reply.replace(b"the generated text", b"the forged text!!!"),
     "signature does not match"),
    (lambda reply: reply.replace(HEADER_REPLY.encode(), b"X-Something-Else"),
     "the reply is not signed"),
], ids=["altered-body", "signature-removed"])
def test_a_reply_altered_on_the_way_is_refused(server: ControlServer, rewrite: Any,
                                                why: str) -> None:
    proxy = ReplyProxy(server.port, rewrite)
    try:
        with pytest.raises(RingError, match=f"GET /status: .*{why}"):
            call(proxy.url, "GET", "/status", auth=Authenticator(SECRET))
    finally:
        proxy.close()


def test_a_reply_replayed_from_an_earlier_request_is_refused(server: ControlServer) -> None:
    first: List[bytes] = []

    def replay(reply: bytes) -> bytes:
        if HEADER_REPLY.encode() not in reply:  # the public /ping
            return reply
        first.append(reply)
        return first[0]  # every reply is the first one, genuinely signed for its request

    proxy = ReplyProxy(server.port, replay)
    try:
        call(proxy.url, "POST", "/status", {"a": 1}, auth=Authenticator(SECRET))
        with pytest.raises(RingError, match="signature does not match"):
            call(proxy.url, "POST", "/status", {"a": 1}, auth=Authenticator(SECRET))
    finally:
        proxy.close()
