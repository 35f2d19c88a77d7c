"""Sealed links on a real ring: a TCP proxy between two real nodes lets the genuine handshake
through, then flips one bit in one frame's payload; the receiving node closes the link with
an integrity error and the generation recovers with the undisturbed text. A worker refuses
a decode step that does not follow its KV cache (stale KV). ``--no-encrypt`` on every node
runs unsealed links, and a starter that disagrees with its workers fails the set-up with one
line."""
from __future__ import annotations

import logging
import socket
import struct
import threading
from pathlib import Path
from typing import Any, List, Optional, Tuple

import pytest
import torch

from mdiedge.base.errors import NodeLost, RingError
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.local import LocalEngine
from mdiedge.roles.local_ring import LocalRing
from mdiedge.engine.ring import RingEngine
from mdiedge.runtime import framing, messages
from mdiedge.runtime.messages import Message

GREEDY = SamplingParams(temperature=0)
PROMPT = "hello ring"
HANDSHAKE_UP = 32 + 3 + 32  # the connector's answer: nonce, codecs and sealing, MAC
Address = Tuple[str, int]


class Tamper:
    """A ``route``: a proxy in front of the ``target``-th endpoint a ring set-up asks for (0:
    the first worker's data port; -1: the starter's), the others direct. It forwards every
    byte both ways, but in the data direction, past the handshake, it flips the exponent's
    top bit of the first value of the ``frame``-th ACTIVATION frame's payload, once."""

    def __init__(self, target: int, frame: int, endpoints: int) -> None:
        self.target, self.frame, self.endpoints = target % endpoints, frame, endpoints
        self.calls = 0
        self.flipped = threading.Event()
        self.sockets: List[socket.socket] = []

    def __call__(self, host: str, port: int) -> Address:
        index, self.calls = self.calls % self.endpoints, self.calls + 1
        if index != self.target or self.flipped.is_set():
            return host, port
        listener = socket.create_server(("127.0.0.1", 0))
        self.sockets.append(listener)
        threading.Thread(target=self._serve, args=(listener, (host, port)), daemon=True).start()
        return listener.getsockname()[:2]

    def _serve(self, listener: socket.socket, target: Address) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(target)
            self.sockets += [client, server]
            threading.Thread(target=_pump, args=(server, client), daemon=True).start()
            threading.Thread(target=self._frames, args=(client, server), daemon=True).start()

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        """Forward the handshake, then whole frames, one of them tampered with."""
        try:
            dst.sendall(_exactly(src, HANDSHAKE_UP))
            seen = 0
            while True:
                head = bytearray(_exactly(src, framing.HEADER_SIZE))
                n = struct.unpack_from("<H", head, 8)[0]
                size = struct.unpack_from("<Q", head, 36)[0]
                tag = framing.TAG_SIZE if head[6] & framing.FLAG_SEALED else 0
                rest = bytearray(_exactly(src, 8 * n + size + tag))
                if head[5] == framing.ACTIVATION and size:
                    seen += 1
                    if seen == self.frame and not self.flipped.is_set():
                        rest[8 * n + 3] ^= 0x40  # float32, little-endian: the exponent's top bit
                        self.flipped.set()
                dst.sendall(bytes(head) + bytes(rest))
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)

    def close(self) -> None:
        for sock in self.sockets:
            _close(sock)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@pytest.fixture(scope="module")
def reference(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model)


@pytest.mark.parametrize("target", [0, -1], ids=["into-w1", "into-starter"])
def test_a_bit_flipped_by_a_proxy_closes_the_link_and_the_request_recovers(
        reference: LocalEngine, ring_model: Path, target: int, capfd: Any, caplog: Any) -> None:
    want = reference.generate(PROMPT, 30, 2, GREEDY)
    tamper = Tamper(target, frame=6, endpoints=3)
    caplog.set_level(logging.WARNING, logger="mdiedge.links")
    try:
        local = LocalRing(2)
        with local as workers:
            engine = RingEngine(workers, ring_model, secret=local.secret, timeout_s=30,
                                stall_s=2.0, route=tamper)
            out = engine.generate(PROMPT, 30, 2, GREEDY)
            engine.close()
    finally:
        tamper.close()
    assert tamper.flipped.is_set()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    assert len(out.recoveries) == 1
    logged = capfd.readouterr().err + caplog.text
    assert "link down: integrity error: sealed frame" in logged, logged[-2000:]


def test_a_worker_refuses_a_decode_that_does_not_follow_its_kv_cache(ring_model: Path,
                                                                     capfd: Any) -> None:
    local = LocalRing(1)
    with local as workers:
        engine = RingEngine(workers, ring_model, secret=local.secret, timeout_s=30, stall_s=2.0)
        try:
            engine.prepare(1, 64)
            tail, dim = engine.starter.tail, engine.starter.cfg.dim
            steps = [(0, 3, True), (3, 1, False), (4, 1, False)]  # 3 prefilled, then decodes
            for seq, (position, tokens, prefill) in enumerate(steps, 1):
                tail.send(Message(messages.ACTIVATION, [7], [position],
                                  torch.randn(1, tokens, dim), prefill, seq))
                assert tail.receive().seq == seq
            tail.send(Message(messages.ACTIVATION, [7], [50], torch.randn(1, 1, dim), seq=4))
            with pytest.raises(NodeLost, match="the ring broke"):
                tail.receive()
        finally:
            engine.close()
    assert ("sample 7 at position 50 does not follow its KV cache (5 positions filled): a "
            "stale or forged step" in capfd.readouterr().err)


def test_no_encrypt_on_every_node_runs_unsealed_links(reference: LocalEngine,
                                                       ring_model: Path) -> None:
    want = reference.generate(PROMPT, 12, 1, GREEDY)
    local = LocalRing(2, encrypt=False)
    with local as workers:
        engine = RingEngine(workers, ring_model, secret=local.secret, timeout_s=30,
                            encrypt=False)
        out = engine.generate(PROMPT, 12, 1, GREEDY)
        links = engine.starter.link_stats()
        engine.close()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    assert [link["sealed"] for link in links] == [False, False, False]


def test_a_starter_that_does_not_seal_fails_the_set_up_with_one_line(ring_model: Path) -> None:
    local = LocalRing(1)
    with local as workers:
        engine = RingEngine(workers, ring_model, secret=local.secret, timeout_s=30,
                            encrypt=False, recover=False)
        with pytest.raises(RingError) as e:
            engine.generate(PROMPT, 4, 1, GREEDY)
        engine.close()
    assert str(e.value) == ("no worker of the ring can join: w1: sealing mismatch: it seals "
                            "its links, this ring runs --no-encrypt (every node needs the same "
                            "setting)")
    assert "\n" not in str(e.value)


class Dropper(Tamper):
    """A ``Tamper`` that swallows the ``frame``-th ACTIVATION frame instead (once), so that,
    with one message in flight, no frame follows it to fail the link's frame counter."""

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            dst.sendall(_exactly(src, HANDSHAKE_UP))
            seen = 0
            while True:
                head = _exactly(src, framing.HEADER_SIZE)
                n = struct.unpack_from("<H", head, 8)[0]
                size = struct.unpack_from("<Q", head, 36)[0]
                tag = framing.TAG_SIZE if head[6] & framing.FLAG_SEALED else 0
                rest = _exactly(src, 8 * n + size + tag)
                if head[5] == framing.ACTIVATION and size:
                    seen += 1
                    if seen == self.frame and not self.flipped.is_set():
                        self.flipped.set()
                        continue
                dst.sendall(head + rest)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                _close(sock)


@pytest.mark.parametrize("target", [0, -1], ids=["into-w1", "into-starter"])
def test_a_frame_dropped_by_a_proxy_is_noticed_within_a_second_or_two_and_recovered(
        reference: LocalEngine, ring_model: Path, target: int) -> None:
    """One sample, so one message in flight: nothing follows the lost frame, and every node
    answers its control port. It was noticed after ``timeout_s`` (60 s; 20 here)."""
    want = reference.generate(PROMPT, 30, 1, GREEDY)
    dropper = Dropper(target, frame=8, endpoints=3)
    try:
        local = LocalRing(2)
        with local as workers:
            engine = RingEngine(workers, ring_model, secret=local.secret, timeout_s=20,
                                route=dropper)
            out = engine.generate(PROMPT, 30, 1, GREEDY)
            engine.close()
    finally:
        dropper.close()
    assert dropper.flipped.is_set()
    assert [s["token_ids"] for s in out.samples] == [s["token_ids"] for s in want.samples]
    assert len(out.recoveries) == 1, out.recoveries
    recovery = out.recoveries[0]
    assert recovery.detect_s + recovery.recover_s < 3, recovery
