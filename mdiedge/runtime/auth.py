"""Ring authentication: nobody without the ring secret can drive a node or join its links.

Control plane: a request carries a timestamp, a fresh nonce, its body's SHA-256 and an HMAC-SHA256
over method, path, body digest, timestamp, nonce and the id of the node it is for (drawn at start,
told on ``/ping``), so it is refused by every other node and replayed to none. ``HEADER_NODE`` names
the id signed for, so a right-secret request for an earlier id (``NODE_CHANGED``: a client from
before a restart) is told from a wrong secret. ``check_headers`` verifies the MAC from the headers
alone (constant time, timestamp within ``MAX_SKEW_S``, unseen nonce) before any body is read;
``accept`` then checks the body's digest and records the nonce only once the whole request verified
(a forged body under genuine headers cannot burn it); meanwhile the nonce is in flight (``release``
if the body never comes), so one captured request holds at most one connection. Replies are signed
(``sign_reply``) and checked (``check_reply``).

Data plane: the ends of a link run a mutual challenge-response, each MACing the other's fresh
challenge with its codecs and sealing, so a mismatch fails both with one line. A sealed link's keys
(``seal``) come from the handshake key and both challenges.

Without a secret (loopback only, or ``--insecure``) the same handshake runs with a fixed public key:
the same protocol, without the protection."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import os
import re
import socket
import threading
import time
from typing import Dict, Mapping, Optional

from ..base.codecs import NO_COMPRESSION, Compression
from ..base.defaults import MAX_SKEW_S
from .seal import LinkKeys, derive
from ..base.errors import AuthError, CodecMismatch, ConfigError, SealMismatch


HEADER_TS, HEADER_NONCE, HEADER_MAC = "X-Mdiedge-Timestamp", "X-Mdiedge-Nonce", "X-Mdiedge-Mac"
HEADER_BODY, HEADER_NODE = "X-Mdiedge-Body-Sha256", "X-Mdiedge-Node"
HEADER_REPLY = "X-Mdiedge-Reply-Mac"
NODE_CHANGED = "signed for another node id"  # how such a refusal starts (logged as routine)
_HEX = re.compile(r"[0-9a-f]{16,64}")
_MAX_NONCES = 10000
_INSECURE_KEY = b"mdiedge-insecure-ring"
_HELLO = b"MDIEHS3\0"  # 2: the link codecs in the handshake; 3: sealing
_NONCE_BYTES = 32


def is_loopback(host: str) -> bool:
    """True only for "localhost" and literal loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class Authenticator:

    def __init__(self, secret: Optional[bytes], node: str = "") -> None:
        self.secret = secret
        self.key = secret if secret else _INSECURE_KEY
        self.node = node  # the node whose requests this one checks (a control server's id)
        self._seen: Dict[str, float] = {}  # nonce -> when it may be forgotten
        self._pending: Dict[str, float] = {}  # nonces whose bodies are being read
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def for_node(self, node: str) -> "Authenticator":
        """The same secret, checking requests signed for ``node``, with nonces of its own."""
        return Authenticator(self.secret, node)

    def _mac(self, method: str, path: str, digest: str, timestamp: str, nonce: str,
             node: str) -> str:
        message = "\n".join((method.upper(), path, digest, timestamp, nonce, node))
        return hmac.new(self.key, message.encode(), hashlib.sha256).hexdigest()

    def sign(self, method: str, path: str, body: bytes, node: str = "") -> Dict[str, str]:
        """Headers of a request for the node whose id is ``node``."""
        if not self.enabled:
            return {}
        timestamp, nonce, digest = f"{time.time():.3f}", os.urandom(16).hex(), body_digest(body)
        mac = self._mac(method, path, digest, timestamp, nonce, node)
        return {HEADER_TS: timestamp, HEADER_NONCE: nonce, HEADER_BODY: digest,
                HEADER_NODE: node, HEADER_MAC: mac}

    def _reply_mac(self, status: int, nonce: str, node: str, body: bytes) -> str:
        message = "\n".join(("reply", str(status), nonce, node, body_digest(body)))
        return hmac.new(self.key, message.encode(), hashlib.sha256).hexdigest()

    def sign_reply(self, status: int, nonce: str, body: bytes) -> str:
        """``HEADER_REPLY`` of this node's reply to the request that carried ``nonce``."""
        return self._reply_mac(status, nonce, self.node, body)

    def check_reply(self, status: int, request: Mapping[str, str], body: bytes,
                    mac: Optional[str]) -> Optional[str]:
        """None if ``mac`` signs this reply to the signed ``request``, else why it is refused."""
        if not self.enabled:
            return None
        if not mac:
            return "the reply is not signed (no ring secret signature)"
        expected = self._reply_mac(status, request.get(HEADER_NONCE) or "",
                                   request.get(HEADER_NODE) or "", body)
        if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected.encode()):
            return "the reply's signature does not match (forged or altered on the way)"
        return None

    def check_headers(self, method: str, path: str, headers: Mapping[str, str]) -> Optional[str]:
        """None for a fresh, genuine signature, else why not; the body digest is ``accept``'s."""
        if not self.enabled:
            return None
        timestamp, nonce, digest, mac = (headers.get(h) or "" for h in
                                         (HEADER_TS, HEADER_NONCE, HEADER_BODY, HEADER_MAC))
        if not (timestamp and nonce and digest and mac):
            return "unauthenticated request (no ring secret signature)"
        if not (_HEX.fullmatch(nonce) and _HEX.fullmatch(digest) and len(digest) == 64):
            return f"malformed signature headers (nonce {nonce[:80]!r}, digest {digest[:80]!r})"
        try:
            age = abs(time.time() - float(timestamp))
        except ValueError:
            return f"bad timestamp {timestamp[:80]!r}"
        if not math.isfinite(age):
            return f"bad timestamp {timestamp[:80]!r}"
        if age > MAX_SKEW_S:
            return f"stale request ({age:.0f} s old; clocks more than {MAX_SKEW_S:.0f} s apart?)"
        expected = self._mac(method, path, digest, timestamp, nonce, self.node).encode()
        if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected):
            return self._mismatch(method, path, headers)
        with self._lock:
            if nonce in self._seen or nonce in self._pending:
                return "replayed request"
            self._pending[nonce] = time.time() + 2 * MAX_SKEW_S
            return None

    def _mismatch(self, method: str, path: str, headers: Mapping[str, str]) -> str:
        """Signed with the ring secret for the id in ``HEADER_NODE`` (another node's, or ours before
        a restart), else with a wrong secret."""
        claimed = headers.get(HEADER_NODE) or ""
        if claimed != self.node and _HEX.fullmatch(claimed):
            mac = (headers.get(HEADER_MAC) or "").encode("utf-8", "surrogateescape")
            theirs = self._mac(method, path, headers.get(HEADER_BODY) or "",
                               headers.get(HEADER_TS) or "", headers.get(HEADER_NONCE) or "",
                               claimed).encode()
            if hmac.compare_digest(mac, theirs):
                return (f"{NODE_CHANGED} ({claimed[:8]}..., this node is {self.node[:8]}...): "
                        f"the ring secret is right; the sender knew this node before it "
                        f"restarted (it asks the new id and retries), or meant another node")
        return "bad signature (wrong ring secret)"

    def accept(self, headers: Mapping[str, str], digest: str) -> Optional[str]:
        """After ``check_headers`` and the body read: None if ``digest`` is the signed one (the
        nonce is recorded), else why not."""
        if not self.enabled:
            return None
        nonce, now = headers.get(HEADER_NONCE) or "", time.time()
        signed = headers.get(HEADER_BODY) or ""
        if not hmac.compare_digest(signed.encode("utf-8", "surrogateescape"), digest.encode()):
            self.release(headers)
            return f"body does not match its signed digest (got sha256 {digest[:16]}...)"
        with self._lock:
            self._pending.pop(nonce, None)
            if nonce in self._seen:
                return "replayed request"
            self._seen[nonce] = now + 2 * MAX_SKEW_S
            if len(self._seen) + len(self._pending) > _MAX_NONCES:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._pending = {n: t for n, t in self._pending.items() if t > now}
        return None

    def release(self, headers: Mapping[str, str]) -> None:
        """The body never came: the nonce is no longer in flight (a genuine sender may still use
        it)."""
        with self._lock:
            self._pending.pop(headers.get(HEADER_NONCE) or "", None)

    def check(self, method: str, path: str, body: bytes,
              headers: Mapping[str, str]) -> Optional[str]:
        return self.check_headers(method, path, headers) or self.accept(headers, body_digest(body))

    # ----------------------------------------------------------------- data-plane handshake

    def _link_mac(self, role: bytes, theirs: bytes, ours: bytes) -> bytes:
        return hmac.new(self.key, role + theirs + ours, hashlib.sha256).digest()

    def accept_link(self, sock: socket.socket, peer: str, timeout: float = 10.0,
                    codecs: Compression = NO_COMPRESSION, seal: bool = True
                    ) -> Optional[LinkKeys]:
        """Acceptor side: challenge, then prove ourselves; both send ``codecs`` and ``seal`` under
        the MAC (a difference: CodecMismatch or SealMismatch). The link's keys when sealed, else
        None."""
        challenge = os.urandom(_NONCE_BYTES)
        with _deadline(sock, timeout):
            sock.sendall(_HELLO + challenge)
            reply = _recv_exact(sock, _NONCE_BYTES + _TERMS_BYTES + 32, peer)
            theirs, mac = reply[:-32], reply[-32:]
            if not hmac.compare_digest(mac, self._link_mac(b"connect", challenge, theirs)):
                raise AuthError(f"data link from {peer} refused: wrong ring secret")
            ours = _terms(codecs, seal)
            sock.sendall(ours + self._link_mac(b"accept", theirs + ours, challenge))
            _agree(codecs, seal, theirs[_NONCE_BYTES:], f"data link from {peer}")
        return derive(self.key, challenge, theirs[:_NONCE_BYTES], False) if seal else None

    def connect_link(self, sock: socket.socket, peer: str, timeout: float = 10.0,
                     codecs: Compression = NO_COMPRESSION, seal: bool = True
                     ) -> Optional[LinkKeys]:
        """Connector side: answer, then check the acceptor's proof, codecs and sealing. Keys as
        ``accept_link``."""
        with _deadline(sock, timeout):
            hello = _recv_exact(sock, len(_HELLO) + _NONCE_BYTES, peer)
            if hello[:len(_HELLO)] != _HELLO:
                raise AuthError(f"{peer} is not an mdiedge data port (or an older version)")
            challenge = hello[len(_HELLO):]
            nonce = os.urandom(_NONCE_BYTES)
            ours = nonce + _terms(codecs, seal)
            sock.sendall(ours + self._link_mac(b"connect", challenge, ours))
            reply = _recv_exact(sock, _TERMS_BYTES + 32, peer)
            theirs, proof = reply[:-32], reply[-32:]
            if not hmac.compare_digest(proof, self._link_mac(b"accept", ours + theirs, challenge)):
                raise AuthError(f"{peer} failed the ring-secret handshake")
            _agree(codecs, seal, theirs, f"data link to {peer}")
        return derive(self.key, challenge, nonce, True) if seal else None


_CODEC_BYTES = 2
_TERMS_BYTES = _CODEC_BYTES + 1  # the codecs, then 1 for a sealed link, 0 for a plain one


def _terms(codecs: Compression, seal: bool) -> bytes:
    return codecs.wire + bytes([1 if seal else 0])


def _sealing(seal: bool) -> str:
    return "seals its frames" if seal else "runs --no-encrypt"


def _agree(ours: Compression, seal: bool, raw: bytes, link: str) -> None:
    """CodecMismatch unless the peer's ``raw`` codecs are ``ours``; SealMismatch unless it seals as
    we do."""
    try:
        theirs = str(Compression.from_wire(raw[:_CODEC_BYTES]))
    except ConfigError as e:
        theirs = str(e)
    if theirs != str(ours):
        raise CodecMismatch(f"{link}: codec mismatch: this node uses {ours}, the other end "
                            f"{theirs}")
    if raw[_CODEC_BYTES] not in (0, 1) or bool(raw[_CODEC_BYTES]) != seal:
        other = _sealing(raw[_CODEC_BYTES] == 1) if raw[_CODEC_BYTES] in (0, 1) else \
            f"sent sealing byte {raw[_CODEC_BYTES]}"
        raise SealMismatch(f"{link}: sealing mismatch: this node {_sealing(seal)}, the other "
                           f"end {other} (both ends need the same setting)")


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
