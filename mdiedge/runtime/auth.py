"""Ring authentication: nobody without the ring secret can drive a node or join its links.

Control plane: each request carries a timestamp, a fresh nonce and an HMAC-SHA256 over method,
path, body digest, timestamp and nonce; a node accepts it only if the MAC matches (constant
time), the timestamp is within ``MAX_SKEW_S`` and the nonce was not seen before (no replay).
Data plane: before any frame, the two ends of a link run a mutual challenge-response: each
proves knowledge of the secret by MACing the other's fresh random challenge.

Without a secret (loopback only, or ``--insecure``) the same handshake runs with a fixed
public key, so the protocol is the same and only the protection is missing.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from typing import Dict, Mapping, Optional

from ..base.errors import RingError

log = logging.getLogger("mdiedge.auth")

MAX_SKEW_S = 60.0
HEADER_TS, HEADER_NONCE, HEADER_MAC = "X-Mdiedge-Timestamp", "X-Mdiedge-Nonce", "X-Mdiedge-Mac"
_INSECURE_KEY = b"mdiedge-insecure-ring"
_HELLO = b"MDIEHS1\0"
_NONCE_BYTES = 32


class AuthError(RingError):
    """A peer failed authentication (wrong or missing secret, replay, stale request)."""


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class Authenticator:
    """Signs and checks control requests, and runs the data-link handshake."""

    def __init__(self, secret: Optional[bytes]) -> None:
        self.secret = secret
        self.key = secret if secret else _INSECURE_KEY
        self._seen: Dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def _mac(self, method: str, path: str, body: bytes, timestamp: str, nonce: str) -> str:
        message = "\n".join((method.upper(), path, hashlib.sha256(body).hexdigest(), timestamp, nonce))
        return hmac.new(self.key, message.encode(), hashlib.sha256).hexdigest()

    def sign(self, method: str, path: str, body: bytes) -> Dict[str, str]:
        if not self.enabled:
            return {}
        timestamp, nonce = f"{time.time():.3f}", os.urandom(16).hex()
        return {HEADER_TS: timestamp, HEADER_NONCE: nonce,
                HEADER_MAC: self._mac(method, path, body, timestamp, nonce)}

    def check(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Optional[str]:
        """None if the request is authentic, else the reason it is refused."""
        if not self.enabled:
            return None
        timestamp, nonce, mac = (headers.get(h) for h in (HEADER_TS, HEADER_NONCE, HEADER_MAC))
        if not (timestamp and nonce and mac):
            return "unauthenticated request (no ring secret signature)"
        try:
            age = abs(time.time() - float(timestamp))
        except ValueError:
            return f"bad timestamp {timestamp!r}"
        if age > MAX_SKEW_S:
            return f"stale request ({age:.0f} s old; clocks more than {MAX_SKEW_S:.0f} s apart?)"
        if not hmac.compare_digest(mac, self._mac(method, path, body, timestamp, nonce)):
            return "bad signature (wrong ring secret)"
        now = time.time()
        with self._lock:
            if nonce in self._seen:
                return "replayed request"
            self._seen[nonce] = now + 2 * MAX_SKEW_S
            if len(self._seen) > 10000:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
        return None

    # ----------------------------------------------------------------- data-plane handshake

    def _link_mac(self, role: bytes, theirs: bytes, ours: bytes) -> bytes:
        return hmac.new(self.key, role + theirs + ours, hashlib.sha256).digest()

    def accept_link(self, sock: socket.socket, peer: str, timeout: float = 10.0) -> None:
        """Acceptor side: challenge the connecting node, then prove ourselves to it."""
        challenge = os.urandom(_NONCE_BYTES)
        with _deadline(sock, timeout):
            sock.sendall(_HELLO + challenge)
            reply = _recv_exact(sock, _NONCE_BYTES + 32, peer)
            theirs, mac = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
            if not hmac.compare_digest(mac, self._link_mac(b"connect", challenge, theirs)):
                log.warning("refused data link from %s: wrong ring secret", peer)
                raise AuthError(f"data link from {peer} refused: wrong ring secret")
            sock.sendall(self._link_mac(b"accept", theirs, challenge))

    def connect_link(self, sock: socket.socket, peer: str, timeout: float = 10.0) -> None:
        """Connector side: answer the challenge, then check the acceptor's proof."""
        with _deadline(sock, timeout):
            hello = _recv_exact(sock, len(_HELLO) + _NONCE_BYTES, peer)
            if hello[:len(_HELLO)] != _HELLO:
                raise AuthError(f"{peer} is not an mdiedge data port")
            challenge = hello[len(_HELLO):]
            ours = os.urandom(_NONCE_BYTES)
            sock.sendall(ours + self._link_mac(b"connect", challenge, ours))
            proof = _recv_exact(sock, 32, peer)
            if not hmac.compare_digest(proof, self._link_mac(b"accept", ours, challenge)):
                raise AuthError(f"{peer} failed the ring-secret handshake")


class _deadline:
    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout

    def __enter__(self) -> None:
        self.saved = self.sock.gettimeout()
        self.sock.settimeout(self.timeout)

    def __exit__(self, *exc: object) -> None:
        self.sock.settimeout(self.saved)


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    data = bytearray()
    try:
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise AuthError(f"{peer} closed the link during the handshake "
                                f"(wrong ring secret?)")
            data += chunk
    except socket.timeout:
        raise AuthError(f"{peer} did not complete the handshake in time") from None
    return bytes(data)
