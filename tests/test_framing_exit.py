"""Early exit on the wire (frame version 3): the header's exit_depth and the eligible bit of
each position word, against the compiled framing module and its pure-Python twin."""
from __future__ import annotations

import socket
import struct
import zlib
from types import ModuleType
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mdiedge.runtime.framing import FRAMING
from mdiedge.base.errors import FrameError
from mdiedge.base.arrays import to_numpy
from mdiedge.runtime import framing, messages
from mdiedge.runtime.messages import Message

pytestmark = pytest.mark.twins
IMPLS = FRAMING.implementations()
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
ACTIVATION, PREFILL = framing.ACTIVATION, framing.FLAG_PREFILL
ONLY = "early exit applies to ACTIVATION frames without PREFILL only"
V2_FIXED = struct.Struct("<4sBBBBHHI4IIQ")  # version 2: ndim a u16, no exit_depth


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


@pytest.fixture
def pair() -> Iterator[Tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def outcome(call: Any) -> str:
    try:
        return repr(call())
    except FrameError as e:
        return f"FrameError: {e}"


def parse(impl: ModuleType, frame: bytes) -> Any:
    header = impl.parse_header(frame[:48], 1 << 20)
    impl.parse_table(header, frame[:48], frame[48:])
    return header


def with_crc(frame: bytes) -> bytes:
    """``frame`` with its crc computed again (so that the field checks must catch a change)."""
    out = bytearray(frame)
    n = struct.unpack_from("<H", out, 8)[0]
    struct.pack_into("<I", out, 44, zlib.crc32(bytes(out[48:48 + 8 * n]),
                                               zlib.crc32(bytes(out[:44]))))
    return bytes(out)


# ------------------------------------------------------------------- round trips

@FAST
@given(rows=st.lists(st.tuples(st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 31 - 1),
                               st.booleans()), min_size=1, max_size=8),
       exit_depth=st.integers(0, 255), flagged=st.booleans())
def test_exit_depth_and_eligible_round_trip(impl: ModuleType, pair: Any, rows: List[Any],
                                            exit_depth: int, flagged: bool) -> None:
    a, b = pair
    ids, positions, bits = ([row[k] for row in rows] for k in range(3))
    tensor = torch.arange(len(rows) * 4, dtype=torch.float32).reshape(len(rows), 1, 4)
    framing.send_tensor(a, ACTIVATION, ids, positions, tensor, seq=3, impl=impl,
                        exit_depth=exit_depth, eligible=bits if flagged else ())
    header, got = framing.recv_frame(b, 1 << 20, impl=impl)
    assert np.array_equal(got, tensor.numpy()) and header.exit_depth == exit_depth
    assert header.sample_ids == tuple(ids) and header.positions == tuple(positions)
    assert header.eligible == (tuple(bits) if flagged else (False,) * len(rows))
    assert all(type(bit) is bool for bit in header.eligible)


def test_frames_without_early_exit_say_so(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    framing.send_tensor(a, ACTIVATION, [1, 2], [0, 0], torch.zeros(2, 3, 4), flags=PREFILL,
                        impl=impl, eligible=[False, False])
    framing.send_control(a, framing.RELEASE, [4], [9], impl=impl)
    for n in (2, 1):
        header, _ = framing.recv_frame(b, 1 << 20, impl=impl)
        assert header.exit_depth == 0 and header.eligible == (False,) * n


def test_messages_carry_exit_depth_and_eligible(pair: Any) -> None:
    a, b = pair
    hidden = torch.ones(3, 1, 8)
    sent = [Message(messages.ACTIVATION, [1, 2, 3], [5, 6, 2 ** 31 - 1], hidden, seq=4,
                    exit_depth=12, eligible=[False, True, True]),
            Message(messages.ACTIVATION, [1, 2, 3], [5, 6, 7], hidden, eligible=[False] * 3),
            Message(messages.ACTIVATION, [1, 2, 3], [0, 0, 0], hidden, prefill=True),
            Message(messages.RELEASE, [1, 2], [0, 0])]
    for message in sent:
        messages.send(a, message)
    got = [messages.receive(b, 1 << 20)[0] for _ in sent]
    assert [(m.exit_depth, m.eligible) for m in got] == \
        [(12, [False, True, True]), (0, []), (0, []), (0, [])]
    assert got[0].positions == [5, 6, 2 ** 31 - 1] and np.array_equal(got[0].hidden, to_numpy(hidden))


# ------------------------------------------------------------------- what is refused

@pytest.mark.parametrize("msg_type,flags,kind", [
    (ACTIVATION, PREFILL, "prefill ACTIVATION"), (framing.RELEASE, 0, "RELEASE"),
    (framing.PING, 0, "PING"), (framing.SHUTDOWN, 0, "SHUTDOWN")])
def test_early_exit_only_on_decode_activations(impl: ModuleType, msg_type: int, flags: int,
                                               kind: str) -> None:
    def pack(**kwargs: Any) -> bytes:
        return impl.pack_header(msg_type, flags, 0, [1, 2], [0, 3], 1, (2, 1, 4), 0, **kwargs)

    with pytest.raises(FrameError, match=f"^exit_depth 1 on a {kind} frame: {ONLY}$"):
        pack(exit_depth=1)
    with pytest.raises(FrameError, match=f"^eligible\\[1\\] True on a {kind} frame: {ONLY}$"):
        pack(eligible=(False, True))
    with pytest.raises(FrameError, match=r"^eligible\[0\] True on"):
        pack(eligible=iter([np.bool_(True), np.bool_(False)]))  # the spec's path, same error
    assert pack(eligible=[False, False]) == pack()


@pytest.mark.parametrize("kwargs,message", [
    (dict(positions=[2 ** 31, 0]), "position 2147483648 outside 0..2147483647"),
    (dict(positions=[0, 2 ** 32 - 1]), "position 4294967295 outside 0..2147483647"),
    (dict(exit_depth=256), "exit_depth 256 outside 0..255"),
    (dict(exit_depth=-1), "exit_depth -1 outside 0..255"),
    (dict(exit_depth=1.0), "exit_depth 1.0 is not an integer"),
    (dict(eligible=[True]), "2 sample ids but 1 eligible flags"),
    (dict(eligible=[True, 2]), "eligible flag 2 outside 0..1"),
    (dict(eligible=[None, True]), "eligible flag None is not an integer"),
])
def test_pack_header_checks_the_new_fields(impl: ModuleType, kwargs: Any, message: str) -> None:
    args = dict(msg_type=ACTIVATION, flags=0, dtype=0, sample_ids=[1, 2], positions=[0, 3],
                n_tokens=1, shape=(2, 1, 4), seq=0)
    args.update(kwargs)
    with pytest.raises(FrameError) as e:
        impl.pack_header(**args)
    assert str(e.value) == message


def test_send_refuses_early_exit_where_it_does_not_apply(impl: ModuleType, pair: Any) -> None:
    a, _ = pair
    with pytest.raises(FrameError, match="^position 2147483648 outside"):
        framing.send_tensor(a, ACTIVATION, [1], [2 ** 31], torch.zeros(1, 1, 4), impl=impl)
    with pytest.raises(FrameError, match=f"^exit_depth 2 on a prefill ACTIVATION frame: {ONLY}"):
        framing.send_tensor(a, ACTIVATION, [1], [0], torch.zeros(1, 1, 4), flags=PREFILL,
                            impl=impl, exit_depth=2)
    with pytest.raises(FrameError, match=f"^eligible\\[0\\] True on a RELEASE frame: {ONLY}"):
        framing.send_control(a, framing.RELEASE, [1], [0], impl=impl, eligible=[True])


@pytest.mark.parametrize("msg_type,flags,kind", [
    (ACTIVATION, PREFILL, "prefill ACTIVATION"), (framing.RELEASE, 0, "RELEASE")])
def test_received_early_exit_must_apply(impl: ModuleType, pair: Any, msg_type: int, flags: int,
                                        kind: str) -> None:
    frame = impl.pack_header(msg_type, flags, 0, [1, 2], [5, 6], 0, (), 0)
    depth = with_crc(frame[:11] + b"\x07" + frame[12:])
    with pytest.raises(FrameError, match=f"^exit_depth 7 on a {kind} frame: {ONLY}$"):
        impl.parse_header(depth[:48], 1 << 20)
    eligible = with_crc(frame[:60] + struct.pack("<I", 6 | 2 ** 31))
    header = impl.parse_header(eligible[:48], 1 << 20)
    with pytest.raises(FrameError, match=f"^eligible\\[1\\] True on a {kind} frame: {ONLY}$"):
        impl.parse_table(header, eligible[:48], eligible[48:])
    a, b = pair
    a.sendall(eligible)
    with pytest.raises(FrameError, match=r"^eligible\[1\] True"):
        framing.recv_frame(b, 1 << 20, impl=impl)


def test_version_2_frames_are_refused(impl: ModuleType, pair: Any) -> None:
    fixed = V2_FIXED.pack(b"MDIE", 2, ACTIVATION, 0, 0, 1, 3, 1, 1, 1, 4, 0, 7, 16)
    table = struct.pack("<II", 9, 0)
    frame = fixed + struct.pack("<I", zlib.crc32(table, zlib.crc32(fixed))) + table
    with pytest.raises(FrameError, match="^unsupported version 2, expected 4$"):
        impl.parse_header(frame[:48], 1 << 20)
    a, b = pair
    a.sendall(frame + bytes(16))
    with pytest.raises(FrameError, match="^unsupported version 2, expected 4$"):
        framing.recv_frame(b, 1 << 20, impl=impl)


# ------------------------------------------------------------------- the twins agree

@FAST
@given(msg_type=st.sampled_from([ACTIVATION, ACTIVATION, framing.RELEASE, framing.PING]),
       flags=st.sampled_from([0, 0, PREFILL]), exit_depth=st.sampled_from([0, 1, 255, 256]),
       rows=st.lists(st.tuples(st.integers(0, 2 ** 32 - 1),
                               st.sampled_from([0, 1, 2 ** 31 - 1, 2 ** 31]), st.booleans()),
                     max_size=6),
       flagged=st.sampled_from(["none", "list", "tuple", "numpy", "short"]))
@example(msg_type=ACTIVATION, flags=0, exit_depth=0, rows=[(0, 0, True)], flagged="short")
def test_twins_pack_early_exit_byte_for_byte(msg_type: int, flags: int, exit_depth: int,
                                             rows: List[Any], flagged: str) -> None:
    ids, positions, bits = ([row[k] for row in rows] for k in range(3))
    eligible: Any = {"none": [], "list": bits, "tuple": tuple(bits), "short": bits[1:],
                     "numpy": np.array(bits, dtype=bool)}[flagged]
    call = (msg_type, flags, 0, ids, positions, 0, (), 5, exit_depth, eligible)
    packed = {outcome(lambda: impl.pack_header(*call)) for impl in IMPLS}
    assert len(packed) == 1, packed
    if packed.pop().startswith("FrameError"):
        return
    frame = IMPLS[0].pack_header(*call)
    assert frame[11] == exit_depth
    words = struct.unpack_from(f"<{2 * len(rows)}I", frame, 48)[1::2]
    marked = bits if len(eligible) else [False] * len(rows)  # empty ("short" of one row): none
    assert list(words) == [p | (2 ** 31 if e else 0) for p, e in zip(positions, marked)]


@FAST
@given(msg_type=st.sampled_from([ACTIVATION, framing.RELEASE, framing.PING]),
       flags=st.sampled_from([0, PREFILL]), byte11=st.integers(0, 255),
       words=st.lists(st.integers(0, 2 ** 32 - 1), min_size=0, max_size=5))
def test_twins_parse_early_exit_alike(msg_type: int, flags: int, byte11: int,
                                      words: List[int]) -> None:
    """Any exit_depth and position words, the crc fixed up: one verdict in every twin."""
    frame = bytearray(IMPLS[0].pack_header(msg_type, flags, 0, list(range(len(words))),
                                           [0] * len(words), 0, (), 0))
    frame[11] = byte11
    for i, word in enumerate(words):
        struct.pack_into("<I", frame, 52 + 8 * i, word)
    frame = bytearray(with_crc(bytes(frame)))
    verdicts = {outcome(lambda: parse(impl, bytes(frame))) for impl in IMPLS}
    assert len(verdicts) == 1, verdicts
    decode = msg_type == ACTIVATION and not flags
    verdict = verdicts.pop()
    eligible = any(w >> 31 for w in words)
    assert verdict.startswith("FrameError") == (not decode and (bool(byte11) or eligible))
