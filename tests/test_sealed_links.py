"""Sealed data links, frame by frame, against the compiled framing module and its twin: frames
sealed under a link's keys round-trip; a bit flipped anywhere in a payload or tag, a header
field changed with its crc fixed up, a frame replayed, reordered or dropped, a cut tag, and
fuzzed sealed streams are all refused (an IntegrityError, or a FrameError for what the header
checks catch first); the handshake derives other keys for every link and direction, and a
sealing mismatch is one line at set-up on both ends."""
from __future__ import annotations

import random
import socket
import struct
import threading
import time
import zlib
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

from mdiedge.runtime.framing import FRAMING
from mdiedge.base.codecs import FP16, INT8, NONE, Compression
from mdiedge.base.errors import FrameError, IntegrityError, SealMismatch
from mdiedge.runtime import framing
from mdiedge.runtime.auth import Authenticator
from mdiedge.runtime.links import Link, LinkDown, LinkPair, accept_authenticated, \
    connect_authenticated, tcp_listen
from mdiedge.runtime.seal import LinkKeys, derive

pytestmark = pytest.mark.twins
IMPLS = FRAMING.implementations()
KEY = b"k" * 32


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


def link_keys() -> Tuple[LinkKeys, LinkKeys]:
    """The connector's and the acceptor's keys of one link."""
    return derive(KEY, b"c" * 32, b"a" * 32, True), derive(KEY, b"c" * 32, b"a" * 32, False)


def wire_of(impl: ModuleType, frames: List[Dict[str, Any]], sealer: Optional[Any]
            ) -> List[bytes]:
    """Each frame's bytes as sent (``send_tensor`` or, without ``tensor``, ``send_control``)."""
    out = []
    for frame in frames:
        a, b = socket.socketpair()
        with a, b:
            args = dict(frame)
            tensor = args.pop("tensor", None)
            if tensor is None:
                size = framing.send_control(a, impl=impl, sealer=sealer, **args)
            else:
                size = framing.send_tensor(a, tensor=tensor, impl=impl, sealer=sealer, **args)
            a.close()
            data = b""
            while len(data) < size:
                data += b.recv(size - len(data))
            out.append(data)
    return out


def feed(data: bytes) -> socket.socket:
    """The reading end of a socket pair whose other end sends ``data``, then closes."""
    a, b = socket.socketpair()

    def write() -> None:
        try:
            a.sendall(data)
        except OSError:
            pass
        a.close()

    threading.Thread(target=write, daemon=True).start()
    b.settimeout(10)
    return b


def receive_all(impl: ModuleType, data: bytes, opener: Optional[Any], n: int,
                buffered: bool = True) -> List[Tuple[Any, Optional[torch.Tensor]]]:
    with feed(data) as sock:
        source = framing.reader(sock, impl) if buffered else sock
        return [framing.recv_frame(source, 1 << 20, impl=impl, opener=opener) for _ in range(n)]


FRAMES = [
    dict(msg_type=framing.ACTIVATION, sample_ids=[3, 4], positions=[0, 0],
         tensor=torch.randn(2, 5, 16), flags=framing.FLAG_PREFILL, seq=1),
    dict(msg_type=framing.ACTIVATION, sample_ids=[3, 4], positions=[5, 5],
         tensor=torch.randn(2, 1, 16), seq=2, exit_depth=2, eligible=[True, False]),
    dict(msg_type=framing.RELEASE, sample_ids=[3], positions=[0], seq=3),
    dict(msg_type=framing.PING, sample_ids=[0], positions=[0],
         tensor=torch.arange(6, dtype=torch.int64), seq=4),
    dict(msg_type=framing.SHUTDOWN),
]


@pytest.mark.parametrize("buffered", [True, False], ids=["reader", "socket"])
def test_sealed_frames_round_trip(impl: ModuleType, buffered: bool) -> None:
    sender, receiver = link_keys()
    wire = wire_of(impl, FRAMES, sender.sealer())
    plain = wire_of(impl, FRAMES, None)
    for sealed, clear, frame in zip(wire, plain, FRAMES):
        tag = framing.TAG_SIZE
        assert len(sealed) == len(clear) + tag
        if "tensor" in frame and frame["tensor"].numel():  # the payload is not in the clear
            assert sealed[len(clear) - frame["tensor"].numel() * frame["tensor"].element_size():
                          -tag] != clear[len(clear) - frame["tensor"].numel()
                                         * frame["tensor"].element_size():]
    got = receive_all(impl, b"".join(wire), receiver.opener(), len(FRAMES), buffered)
    for (header, tensor), frame, sealed in zip(got, FRAMES, wire):
        assert header.flags & framing.FLAG_SEALED
        assert framing.frame_bytes(header) == len(sealed)
        assert list(header.sample_ids) == frame.get("sample_ids", [])
        if "tensor" in frame:
            assert tensor is not None and np.array_equal(tensor, frame["tensor"].reshape(
                tensor.shape).numpy())
        else:
            assert tensor is None


@pytest.mark.parametrize("codec", [NONE, FP16, INT8])
def test_a_sealed_coded_frame_fills_the_callers_tensor(impl: ModuleType, codec: int) -> None:
    sender, receiver = link_keys()
    x = torch.randn(2, 3, 64)
    (wire,) = wire_of(impl, [dict(msg_type=framing.ACTIVATION, sample_ids=[1, 2],
                                  positions=[0, 0], tensor=x, codec=codec)], sender.sealer())
    out = np.empty_like(x.numpy())
    with feed(wire) as sock:
        _, got = framing.recv_frame(sock, 1 << 20, out=out, impl=impl,
                                    opener=receiver.opener())
    assert got is out
    assert np.allclose(out, x.numpy(), atol=0.05 if codec else 0.0)


def flips(wire: bytes, start: int) -> List[bytes]:
    """``wire`` with one bit flipped, at each of a spread of offsets from ``start`` on."""
    out = []
    for offset in sorted({start, (start + len(wire)) // 2, len(wire) - 17, len(wire) - 1}):
        if offset >= start:
            data = bytearray(wire)
            data[offset] ^= 1 << (offset % 8)
            out.append(bytes(data))
    return out


@pytest.mark.parametrize("index", range(len(FRAMES)))
def test_a_bit_flipped_in_a_payload_or_tag_is_an_integrity_error(impl: ModuleType,
                                                                  index: int) -> None:
    sender, receiver = link_keys()
    (wire,) = wire_of(impl, [FRAMES[index]], sender.sealer())
    n = len(FRAMES[index].get("sample_ids", []))
    for data in flips(wire, framing.HEADER_SIZE + 8 * n):  # past header and table
        with pytest.raises(IntegrityError, match="sealed frame 0 failed authentication"):
            receive_all(impl, data, receiver.opener(), 1)


def test_a_header_changed_with_its_crc_fixed_up_is_an_integrity_error(impl: ModuleType) -> None:
    sender, receiver = link_keys()
    (wire,) = wire_of(impl, [FRAMES[1]], sender.sealer())
    data = bytearray(wire)
    struct.pack_into("<I", data, 52, 6)  # the first row's position: 5 -> 6, crc fixed up
    struct.pack_into("<I", data, 44, zlib.crc32(bytes(data[48:64]),
                                                zlib.crc32(bytes(data[:44]))))
    with pytest.raises(IntegrityError):
        receive_all(impl, bytes(data), receiver.opener(), 1)
    data[32] ^= 1  # the seq, without the crc fixed up: the header check catches it first
    with pytest.raises(FrameError, match="crc32"):
        receive_all(impl, bytes(data), receiver.opener(), 1)


@pytest.mark.parametrize("order, bad", [([0, 0], 1), ([1, 0], 0), ([0, 2], 1), ([0, 1, 1], 2)],
                         ids=["replayed", "reordered", "dropped", "replayed-later"])
def test_replayed_reordered_and_dropped_frames_are_refused(impl: ModuleType, order: List[int],
                                                           bad: int) -> None:
    sender, receiver = link_keys()
    wire = wire_of(impl, FRAMES[:3], sender.sealer())
    opener = receiver.opener()
    with feed(b"".join(wire[i] for i in order)) as sock:
        source = framing.reader(sock, impl)
        for _ in range(bad):
            framing.recv_frame(source, 1 << 20, impl=impl, opener=opener)
        with pytest.raises(IntegrityError, match=f"sealed frame {bad} failed"):
            framing.recv_frame(source, 1 << 20, impl=impl, opener=opener)


def test_a_cut_tag_and_a_sealing_the_link_did_not_agree_on_are_frame_errors(
        impl: ModuleType) -> None:
    sender, receiver = link_keys()
    sealed = wire_of(impl, FRAMES[:1], sender.sealer())[0]
    plain = wire_of(impl, FRAMES[:1], None)[0]
    with pytest.raises(FrameError, match="connection closed after"):
        receive_all(impl, sealed[:-5], receiver.opener(), 1)
    with pytest.raises(FrameError, match="a sealed frame on a link that agreed on plain"):
        receive_all(impl, sealed, None, 1)
    with pytest.raises(FrameError, match="an unsealed frame on a link that agreed on sealed"):
        receive_all(impl, plain, receiver.opener(), 1)


def test_the_keys_differ_by_direction_and_by_nonce() -> None:
    connector, acceptor = link_keys()
    assert connector.send == acceptor.receive and connector.receive == acceptor.send
    assert connector.send != connector.receive
    other = derive(KEY, b"c" * 32, b"b" * 32, True)
    assert other.send != connector.send and other.receive != connector.receive


# ------------------------------------------------------------------- fuzzing sealed streams

def random_frames(rng: random.Random) -> List[Dict[str, Any]]:
    frames: List[Dict[str, Any]] = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(0, 3)
        frame: Dict[str, Any] = dict(msg_type=rng.choice([1, 2, 3, 5]),
                                     sample_ids=[rng.randrange(2 ** 32) for _ in range(n)],
                                     positions=[rng.randrange(1 << 20) for _ in range(n)],
                                     seq=rng.randrange(2 ** 32))
        if frame["msg_type"] in (1, 3):
            frame["tensor"] = torch.randn(*[rng.randint(1, 4) for _ in range(rng.randint(1, 3))])
        frames.append(frame)
    return frames


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Flipped bits, a cut, an insertion or a deletion: something always changes."""
    data = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        for _ in range(rng.randint(0, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        data = data[:rng.randrange(len(data))]
    elif kind == 2:
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        at = rng.randrange(len(data))
        del data[at:at + rng.randint(1, 64)]
    return bytes(data)


def test_fuzzed_sealed_streams_end_in_a_frame_error_having_yielded_only_genuine_frames(
        impl: ModuleType) -> None:
    rng = random.Random(20261125)
    deadline = time.monotonic() + 6
    rounds = 0
    while time.monotonic() < deadline and rounds < 600:
        rounds += 1
        sender, receiver = link_keys()
        frames = random_frames(rng)
        wire = wire_of(impl, frames, sender.sealer())
        opener = receiver.opener()
        with feed(mutate(rng, b"".join(wire))) as sock:
            source = framing.reader(sock, impl)
            with pytest.raises(FrameError):  # an IntegrityError, a header check, or the end
                for i in range(len(frames) + 1):
                    header, tensor = framing.recv_frame(source, 1 << 20, impl=impl,
                                                        opener=opener)
                    assert header.wire == wire[i][:len(header.wire)]  # genuine, or refused
                    if tensor is not None:
                        assert np.array_equal(tensor, frames[i]["tensor"].reshape(tensor.shape).numpy())
    assert rounds >= 100


# ------------------------------------------------------------------- the handshake

def handshake(seal_acceptor: bool, seal_connector: bool) -> Dict[str, Any]:
    auth = Authenticator(b"0123456789abcdef-secret")
    results: Dict[str, Any] = {}
    with tcp_listen("127.0.0.1", 0) as listener:
        port = listener.getsockname()[1]

        def accept() -> None:
            try:
                results["accept"] = accept_authenticated(listener, auth, 5.0, "test",
                                                         seal=seal_acceptor)
            except Exception as e:  # noqa: BLE001
                results["accept"] = e

        thread = threading.Thread(target=accept)
        thread.start()
        try:
            results["connect"] = connect_authenticated("127.0.0.1", port, auth, "peer",
                                                       retry_s=3.0, seal=seal_connector)
        except Exception as e:  # noqa: BLE001
            results["connect"] = e
        thread.join(10)
    for link in results.values():
        if isinstance(link, Link):
            link.close()
    return results


def test_each_handshake_gives_the_link_keys_of_its_own() -> None:
    first, second = handshake(True, True), handshake(True, True)
    assert first["connect"].keys.send == first["accept"].keys.receive
    assert first["connect"].keys.receive == first["accept"].keys.send
    assert first["connect"].keys.send != second["connect"].keys.send
    plain = handshake(False, False)
    assert plain["connect"].keys is None and plain["accept"].keys is None


def test_a_sealing_mismatch_is_one_line_at_set_up_on_both_ends() -> None:
    ends = handshake(True, False)
    assert isinstance(ends["connect"], SealMismatch)
    assert str(ends["connect"]) == ("data link to peer: sealing mismatch: this node runs "
                                    "--no-encrypt, the other end seals its frames (both ends "
                                    "need the same setting)")
    assert isinstance(ends["accept"], SealMismatch)
    assert "this node seals its frames, the other end runs --no-encrypt" in str(ends["accept"])
    assert "\n" not in str(ends["accept"])
    codecs = Compression.parse("int8")
    assert codecs.wire  # the codecs travel beside the sealing byte, both under the MAC


# ------------------------------------------------------------------- a link's receiver

@pytest.mark.parametrize("order, bad", [([0, 0], 1), ([1, 0], 0), ([0, 2], 1)],
                         ids=["replayed", "reordered", "dropped"])
def test_a_receiver_closes_its_link_on_a_frame_out_of_order(
        impl: ModuleType, order: List[int], bad: int, monkeypatch: pytest.MonkeyPatch,
        caplog: Any) -> None:
    monkeypatch.setattr(framing, "_impl", impl)
    sender, receiver = link_keys()
    wire = wire_of(impl, FRAMES[:3], sender.sealer())
    out, unused = socket.socketpair()
    pair = LinkPair(Link(feed(b"".join(wire[i] for i in order)), receiver), Link(out, sender),
                    1 << 20, "test", inline_receive=True)
    try:
        got = [pair.receive() for _ in range(len(order))]
    finally:
        pair.close()
        unused.close()
    assert [isinstance(g, LinkDown) for g in got] == [i >= bad for i in range(len(order))]
    down = got[bad]
    assert down.reason.startswith("integrity error: sealed frame")
    assert "\n" not in down.reason
    assert "test/recv: link down: integrity error" in caplog.text
