"""Data-plane framing over real sockets, against the compiled module and its pure-Python twin."""
from __future__ import annotations

import signal
import socket
import struct
import threading
import time
import re
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mdiedge.base import dtypes
from mdiedge.base.arrays import to_numpy
from mdiedge.runtime import _framingconstants
from mdiedge.runtime import framing
from mdiedge.runtime.framing import FRAMING
from mdiedge.base.errors import FrameError

pytestmark = pytest.mark.twins
IMPLS = FRAMING.implementations()
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
U32 = 2 ** 32 - 1


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


@pytest.fixture
def pair() -> Iterator[Tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def tcp_pair() -> Iterator[Tuple[socket.socket, socket.socket]]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    client.settimeout(None)
    # small kernel buffers force many partial reads and writes
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    yield client, server
    client.close()
    server.close()


def random_tensor(shape: Tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs included for floats): equality is checked on bytes."""
    g = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: Any, b: Any) -> bool:
    """The same frame dtype, shape and bytes (a torch tensor against the numpy array it was
    received as: bfloat16 as uint16 words)."""
    a, b = to_numpy(a), to_numpy(b)
    return (framing.dtype_code(a.dtype) == framing.dtype_code(b.dtype) and a.shape == b.shape
            and bytes(framing.tensor_bytes(a)) == bytes(framing.tensor_bytes(b)))


def outcome(call: Callable[[], Any]) -> str:
    """The result or FrameError message of ``call``; any other exception fails the test."""
    try:
        return repr(call())
    except FrameError as e:
        assert "\n" not in str(e)
        return f"FrameError: {e}"


def valid_frame(impl: ModuleType = IMPLS[0]) -> bytes:
    return impl.pack_header(framing.ACTIVATION, framing.FLAG_PREFILL, 1, [7, 9], [0, 5], 3,
                            (2, 3, 4), 41)


# ------------------------------------------------------------------- round trips over sockets

@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize("shape", [(1, 1, 8), (3, 5, 16), (2, 7), (11,), (2, 1, 3, 4), (0, 4),
                                   (2, 0, 8)])
def test_round_trip_is_bit_exact(impl: ModuleType, pair: Any, dtype: torch.dtype,
                                 shape: Tuple[int, ...]) -> None:
    a, b = pair
    tensor = random_tensor(shape, dtype)
    ids, positions = list(range(100, 100 + max(1, shape[0]))), list(range(max(1, shape[0])))
    framing.send_tensor(a, framing.ACTIVATION, ids, positions, tensor, flags=framing.FLAG_PREFILL,
                        seq=12345, impl=impl)
    header, got = framing.recv_frame(b, 1 << 20, impl=impl)
    assert same_bits(tensor, got)
    assert (header.msg_type, header.flags, header.seq) == (framing.ACTIVATION, framing.FLAG_PREFILL,
                                                           12345)
    assert header.sample_ids == tuple(ids) and header.positions == tuple(positions)
    assert header.shape == shape and header.dtype == framing.dtype_code(dtype)
    assert header.n_tokens == (shape[1] if len(shape) >= 2 else 1)
    assert header.payload_len == tensor.numel() * tensor.element_size()


def test_extreme_header_values_survive(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    ids = list(range(U32 - framing.MAX_SAMPLES + 1, U32 + 1))
    positions = [framing.MAX_POSITION - i for i in range(framing.MAX_SAMPLES)]
    tensor = random_tensor((framing.MAX_SAMPLES, 1, 2), torch.float16)
    framing.send_tensor(a, framing.PING, ids, positions, tensor, seq=U32, impl=impl)
    header, got = framing.recv_frame(b, 1 << 20, impl=impl)
    assert header.sample_ids == tuple(ids) and header.positions == tuple(positions)
    assert header.seq == U32 and same_bits(tensor, got)


def test_non_contiguous_tensor_is_sent_contiguous(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).transpose(1, 2)
    with torch.inference_mode():
        framing.send_tensor(a, framing.ACTIVATION, [1, 2], [0, 0], tensor, impl=impl)
        header, got = framing.recv_frame(b, 1 << 20, impl=impl)
    assert header.shape == (2, 4, 3) and np.array_equal(got, tensor.numpy())


@pytest.mark.parametrize("msg_type",
                         [framing.RELEASE, framing.PING, framing.SHUTDOWN])
def test_control_frames(impl: ModuleType, pair: Any, msg_type: int) -> None:
    a, b = pair
    framing.send_control(a, msg_type, [3, 4, 5], [0, 17, 2], seq=9, impl=impl)
    framing.send_control(a, msg_type, impl=impl)
    header, got = framing.recv_frame(b, 0, impl=impl)
    assert got is None
    assert (header.msg_type, header.flags, header.seq, header.shape, header.payload_len) == \
        (msg_type, 0, 9, (), 0)
    assert header.sample_ids == (3, 4, 5) and header.positions == (0, 17, 2)
    header, got = framing.recv_frame(b, 0, impl=impl)
    assert got is None and header.sample_ids == () and header.seq == 0


def test_four_megabytes_over_tcp(impl: ModuleType, tcp_pair: Any) -> None:
    client, server = tcp_pair
    tensors = [random_tensor((4, 256, 1024), torch.float32, seed=s) for s in (1, 2)]
    errors: List[BaseException] = []

    def sender() -> None:
        try:
            framing.send_tensor(client, framing.ACTIVATION, [1, 2, 3, 4], [0] * 4, tensors[0],
                                seq=1, impl=impl)
            client.settimeout(10.0)  # the poll() path of a socket with a timeout
            framing.send_tensor(client, framing.ACTIVATION, [5], [6], tensors[1], seq=2, impl=impl)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=sender)
    thread.start()
    header1, got1 = framing.recv_frame(server, 8 << 20, impl=impl)
    server.settimeout(10.0)
    header2, got2 = framing.recv_frame(server, 8 << 20, impl=impl)
    thread.join()
    assert not errors
    assert header1.seq == 1 and header2.seq == 2 and header2.sample_ids == (5,)
    assert same_bits(got1, tensors[0]) and same_bits(got2, tensors[1])


def test_receive_into_out(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    tensor = random_tensor((2, 3, 8), torch.bfloat16)
    out = np.zeros((2, 3, 8), dtype=np.uint16)  # bfloat16 words
    framing.send_tensor(a, framing.ACTIVATION, [1, 2], [0, 0], tensor, impl=impl)
    _, got = framing.recv_frame(b, 1 << 20, out=out, impl=impl)
    assert got is out and same_bits(out, tensor)


@pytest.mark.parametrize("out", [np.zeros((2, 3, 7), dtype=np.uint16),
                                 np.zeros((2, 3, 8), dtype=np.float16),
                                 np.zeros((2, 8, 3), dtype=np.uint16).transpose(0, 2, 1),
                                 np.frombuffer(bytes(96), dtype=np.uint16).reshape(2, 3, 8),
                                 torch.zeros(2, 3, 8, dtype=torch.bfloat16)],
                         ids=["shape", "dtype", "non-contiguous", "read-only", "torch"])
def test_mismatched_out_is_a_frame_error(impl: ModuleType, pair: Any, out: Any) -> None:
    a, b = pair
    framing.send_tensor(a, framing.ACTIVATION, [1, 2], [0, 0],
                        random_tensor((2, 3, 8), torch.bfloat16), impl=impl)
    with pytest.raises(FrameError, match="does not fit the frame's"):
        framing.recv_frame(b, 1 << 20, out=out, impl=impl)


# ------------------------------------------------------------------- the raw byte loops

@pytest.mark.parametrize("make", [bytearray, lambda n: np.zeros(n // 4, dtype=np.float32),
                                  lambda n: memoryview(bytearray(n)),
                                  lambda n: np.zeros((n // 8, 2), dtype=np.int32)],
                         ids=["bytearray", "float32 array", "memoryview", "2-d array"])
def test_recv_exact_into_any_writable_buffer(impl: ModuleType, pair: Any, make: Any) -> None:
    a, b = pair
    data = bytes(range(256)) * 4
    impl.send_all(a, data[:100], memoryview(data)[100:])
    buffer = make(len(data))
    impl.recv_exact_into(b, buffer)
    assert bytes(memoryview(buffer).cast("B")) == data


def test_read_only_or_strided_buffers_are_refused(impl: ModuleType, pair: Any) -> None:
    _, b = pair
    with pytest.raises(FrameError, match="read-only"):
        impl.recv_exact_into(b, b"abcd")
    with pytest.raises(FrameError, match="not C-contiguous"):
        impl.recv_exact_into(b, np.zeros((4, 4), dtype=np.uint8)[:, 1])


def test_send_all_without_payload(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    impl.send_all(a, b"head", None)
    impl.send_all(a, b"", b"body")
    buffer = bytearray(8)
    impl.recv_exact_into(b, buffer)
    assert buffer == b"headbody"


def test_socket_timeout_is_honoured(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    a.sendall(b"xy")
    b.settimeout(0.05)
    with pytest.raises(socket.timeout):
        impl.recv_exact_into(b, bytearray(4))


def test_a_blocked_receive_lets_other_threads_run(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    b.settimeout(5.0)  # if the GIL were held, the receive would end only at this timeout
    buffer = bytearray(4)
    thread = threading.Thread(target=impl.recv_exact_into, args=(b, buffer))
    thread.start()
    time.sleep(0.05)
    assert sum(range(100000)) and thread.is_alive()
    a.sendall(b"abcd")
    thread.join(5.0)
    assert buffer == b"abcd"


class Interrupted(Exception):
    pass


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_signals_during_a_blocked_receive(impl: ModuleType, pair: Any) -> None:
    """A signal handler runs while recv waits (EINTR); its exception ends the receive."""
    a, b = pair
    calls: List[int] = []

    def handler(signum: int, frame: Any) -> None:
        calls.append(signum)
        if len(calls) == 1:
            a.sendall(b"ab")  # progress, then the receive goes on waiting
        else:
            raise Interrupted()

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.03, 0.03)
        with pytest.raises(Interrupted):
            impl.recv_exact_into(b, bytearray(4))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(calls) == 2


@pytest.mark.parametrize("cut", [0, 20, 47, 48 + 8, 48 + 16 + 10])
def test_peer_closing_mid_frame(impl: ModuleType, pair: Any, cut: int) -> None:
    a, b = pair
    frame = valid_frame() + bytes(48)  # header, table of 2, float16 payload of 2*3*4
    a.sendall(frame[:cut])
    a.shutdown(socket.SHUT_WR)
    expected = {0: "0 of 48", 20: "20 of 48", 47: "47 of 48", 56: "8 of 16", 74: "10 of 48"}[cut]
    with pytest.raises(FrameError, match=f"connection closed after {expected} bytes"):
        framing.recv_frame(b, 1 << 20, impl=impl)


@FAST
@given(data=st.data())
def test_truncated_frames_are_frame_errors(impl: ModuleType, data: st.DataObject) -> None:
    frame = valid_frame() + bytes(48)
    cut = data.draw(st.integers(0, len(frame) - 1))
    a, b = socket.socketpair()
    try:
        a.sendall(frame[:cut])
        a.close()
        with pytest.raises(FrameError, match="closed after"):
            framing.recv_frame(b, 1 << 20, impl=impl)
    finally:
        b.close()


# ------------------------------------------------------------------- validation

def corrupt(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(frame)
    struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize("offset,fmt,value,message", [
    (0, "I", 0x4549444E, "bad magic b'NDIE', expected b'MDIE'"),
    (4, "B", 2, "unsupported version 2, expected 4"),
    (6, "B", 0x06, "unknown codec 3 in flags 0x06"),
    (6, "B", 0x02, "codec fp16 with dtype code 1: codecs apply to float32 (0) only"),
    (5, "B", 0, "unknown msg_type 0"),
    (5, "B", 6, "unknown msg_type 6"),
    (5, "B", 4, "unknown msg_type 4"),  # reserved: the PONG no node sent
    (6, "B", 0x81, "reserved bits set in flags 0x81"),
    (7, "B", 7, "unknown dtype code 7"),
    (8, "H", 1025, "n_samples 1025 exceeds MAX_SAMPLES 1024"),
    (10, "B", 5, "ndim 5 exceeds 4"),
    (10, "B", 2, "shape (2, 3, 4, 0) has nonzero dim 4 beyond ndim 2"),
    (16, "I", 3, "payload_len 48 does not match shape (3, 3, 4) of dtype code 1 (72 bytes with codec none)"),
    (36, "Q", 2 ** 63, "payload_len 9223372036854775808 does not match shape (2, 3, 4) of dtype "
                       "code 1 (48 bytes with codec none)"),
    (36, "Q", 0, "payload_len 0 does not match shape"),
])
def test_each_bad_field_is_named(impl: ModuleType, offset: int, fmt: str, value: int,
                                 message: str) -> None:
    fixed = corrupt(valid_frame(), offset, fmt, value)[:48]
    with pytest.raises(FrameError) as e:
        impl.parse_header(fixed, 1 << 20)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("offset,fmt,value", [(12, "I", 4), (32, "I", 42), (44, "I", 0),
                                              (48, "I", 8), (60, "I", 6)],
                         ids=["n_tokens", "seq", "crc32", "sample id", "position"])
def test_fields_only_the_crc_covers(impl: ModuleType, offset: int, fmt: str, value: int) -> None:
    frame = corrupt(valid_frame(), offset, fmt, value)
    header = impl.parse_header(frame[:48], 1 << 20)
    with pytest.raises(FrameError, match=r"^crc32 0x[0-9a-f]{8} does not match header and table"):
        impl.parse_table(header, frame[:48], frame[48:])


def test_table_length_is_checked(impl: ModuleType) -> None:
    frame = valid_frame()
    header = impl.parse_header(frame[:48], 1 << 20)
    with pytest.raises(FrameError, match="sample table is 8 bytes, expected 16"):
        impl.parse_table(header, frame[:48], frame[48:56])
    with pytest.raises(FrameError, match="fixed header is 47 bytes, expected 48"):
        impl.parse_header(frame[:47], 1 << 20)


def test_max_payload_is_respected(impl: ModuleType, pair: Any) -> None:
    fixed = valid_frame()[:48]  # a 48-byte payload
    assert impl.parse_header(fixed, 48).payload_len == 48
    with pytest.raises(FrameError, match="^payload_len 48 exceeds max_payload 47$"):
        impl.parse_header(fixed, 47)
    a, b = pair
    framing.send_tensor(a, framing.ACTIVATION, [1], [0], torch.zeros(1, 2, 8), impl=impl)
    with pytest.raises(FrameError, match="^payload_len 64 exceeds max_payload 63$"):
        framing.recv_frame(b, 63, impl=impl)


def test_huge_payload_is_refused_before_allocation(impl: ModuleType, pair: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def no_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("allocated for an invalid frame")

    monkeypatch.setattr(np, "empty", no_allocation)
    a, b = pair
    # a consistent header for a (2**31, 2**30) float32 tensor: 2**63 bytes
    a.sendall(impl.pack_header(framing.ACTIVATION, 0, 0, [1], [0], 2 ** 30, (2 ** 31, 2 ** 30), 1))
    with pytest.raises(FrameError, match="^payload_len 9223372036854775808 exceeds max_payload"):
        framing.recv_frame(b, 64 << 20, impl=impl)
    a, b = socket.socketpair()  # after a FrameError the stream is out of step: a new link
    with a, b:
        a.sendall(corrupt(valid_frame(impl), 36, "Q", 2 ** 63))
        with pytest.raises(FrameError, match="^payload_len 9223372036854775808 does not match"):
            framing.recv_frame(b, 2 ** 64, impl=impl)


@pytest.mark.parametrize("dims,max_payload,message", [
    ((0, U32, U32), 1 << 20, "shape (0, 4294967295, 4294967295) of dtype code 0 exceeds "
                             "max_payload 1048576: its nonzero dims span 73786976260478468100 "
                             "bytes"),
    ((U32, 0), 1 << 20, "shape (4294967295, 0) of dtype code 0 exceeds max_payload 1048576: "
                        "its nonzero dims span 17179869180 bytes"),
    ((2, 0, 8), 63, "shape (2, 0, 8) of dtype code 0 exceeds max_payload 63: its nonzero dims "
                    "span 64 bytes"),
])
def test_every_dim_is_bounded_even_with_no_elements(impl: ModuleType, dims: Tuple[int, ...],
                                                    max_payload: int, message: str) -> None:
    """A zero dim empties the tensor but must not let the others grow past max_payload
    (``torch.empty((0, 2**32-1, 2**32-1))`` raises RuntimeError, not FrameError)."""
    fixed = impl.pack_header(framing.ACTIVATION, 0, 0, [], [], 0, dims, 0)
    with pytest.raises(FrameError) as raised:
        impl.parse_header(fixed, max_payload)
    assert str(raised.value) == message
    if max(dims) < 16:  # within bounds, the same empty shape is a valid frame
        assert impl.parse_header(fixed, 64).shape == dims


@pytest.mark.parametrize("kwargs,message", [
    (dict(msg_type=9), "unknown msg_type 9"),
    (dict(msg_type=-1), "msg_type -1 outside 0..255"),
    (dict(flags=0x40), "reserved bits set in flags 0x40"),
    (dict(flags=6), "unknown codec 3 in flags 0x06"),
    (dict(flags=4, dtype=2), "codec int8 with dtype code 2"),
    (dict(dtype=7), "unknown dtype code 7"),
    (dict(dtype="f4"), "dtype 'f4' is not an integer"),
    (dict(sample_ids=[2 ** 32]), "sample id 4294967296 outside 0..4294967295"),
    (dict(positions=[-1]), "position -1 outside 0..2147483647"),
    (dict(positions=[0, 1]), "1 sample ids but 2 positions"),
    (dict(sample_ids=[0] * 1025, positions=[0] * 1025), "n_samples 1025 exceeds MAX_SAMPLES 1024"),
    (dict(shape=(1, 1, 1, 1, 1)), "ndim 5 exceeds 4"),
    (dict(shape=(2.0,)), "shape dim 2.0 is not an integer"),
    (dict(n_tokens=2 ** 32), "n_tokens 4294967296 outside 0..4294967295"),
    (dict(seq=2 ** 32), "seq 4294967296 outside 0..4294967295"),
    (dict(shape=(U32, U32, U32, U32), dtype=3), "payload_len "),
])
def test_pack_header_validates(impl: ModuleType, kwargs: Any, message: str) -> None:
    args = dict(msg_type=1, flags=0, dtype=0, sample_ids=[1], positions=[0], n_tokens=1,
                shape=(1, 1, 4), seq=0)
    args.update(kwargs)
    with pytest.raises(FrameError) as e:
        impl.pack_header(**args)
    assert str(e.value).startswith(message)


def test_pack_header_takes_any_integers_and_sequences(impl: ModuleType) -> None:
    """numpy integers, bools, ranges and iterators pack as the plain ints they stand for."""
    plain = impl.pack_header(1, 1, 0, [5, 6], [0, 7], 2, (2, 2, 4), 9)
    assert impl.pack_header(np.uint8(1), True, np.int64(0), range(5, 7), iter([0, 7]),
                            np.uint32(2), torch.Size([2, 2, 4]), np.int32(9)) == plain
    assert impl.pack_header(1, 1, 0, (5, 6), (0, 7), 2, [np.int64(2), 2, 4], 9) == plain


def test_send_tensor_refuses_what_it_cannot_frame(impl: ModuleType, pair: Any) -> None:
    a, _ = pair
    with pytest.raises(FrameError, match="0-dim tensor"):
        framing.send_tensor(a, framing.PING, [0], [0], torch.tensor(1.0), impl=impl)
    with pytest.raises(FrameError, match="dtype torch.int16 cannot be framed"):
        framing.send_tensor(a, framing.PING, [0], [0], torch.zeros(2, dtype=torch.int16),
                            impl=impl)


# ------------------------------------------------------------------- properties, twins agree

@FAST
@given(data=st.binary(min_size=0, max_size=120), max_payload=st.integers(0, 2 ** 64))
def test_arbitrary_bytes_give_frame_errors_only(data: bytes, max_payload: int) -> None:
    """Whatever arrives, parsing gives a header or a FrameError, the same in every twin."""
    def parse(impl: ModuleType) -> Any:
        header = impl.parse_header(data[:48], max_payload)
        impl.parse_table(header, data[:48], data[48:])
        return header

    assert len({outcome(lambda: parse(impl)) for impl in IMPLS}) == 1


@FAST
@given(n_samples=st.integers(0, 6), ndim=st.integers(0, 4), fill=st.integers(0, 2 ** 32 - 1),
       field_value=st.integers(0, 2 ** 64 - 1), field=st.sampled_from(
           [(0, "I"), (4, "B"), (5, "B"), (6, "B"), (7, "B"), (8, "H"), (10, "B"), (11, "B"),
            (12, "I"), *[(o, "I") for o in range(16, 36, 4)], (36, "Q"), (44, "I")]))
def test_any_corrupted_field_is_detected(n_samples: int, ndim: int, fill: int, field_value: int,
                                         field: Tuple[int, str]) -> None:
    """A valid frame with one field changed gives a FrameError, the same in every twin."""
    offset, fmt = field
    value = field_value % (1 << (8 * struct.calcsize(fmt)))
    frame = IMPLS[0].pack_header(framing.ACTIVATION, 0, 5, [fill] * n_samples,
                                 [fill // 3] * n_samples, 2, (3,) * ndim, fill)
    original = struct.unpack_from("<" + fmt, frame, offset)[0]
    bad = corrupt(frame, offset, fmt, value)

    def parse(impl: ModuleType) -> Any:
        header = impl.parse_header(bad[:48], 1 << 20)
        impl.parse_table(header, bad[:48], bad[48:])
        return header

    outcomes = {outcome(lambda: parse(impl)) for impl in IMPLS}
    assert len(outcomes) == 1
    if value != original:
        assert outcomes.pop().startswith("FrameError")


@FAST
@given(position=st.integers(0, 48 + 8 * 3 - 1), xor=st.integers(1, 255))
def test_any_flipped_byte_is_detected(position: int, xor: int) -> None:
    """CRC32 catches every single-byte error that field checks let through."""
    frame = bytearray(IMPLS[0].pack_header(1, 0, 0, [1, 2, 3], [4, 5, 6], 1, (3, 1, 1), 0))
    frame[position] ^= xor

    def parse(impl: ModuleType) -> Any:
        header = impl.parse_header(frame[:48], 1 << 20)
        impl.parse_table(header, frame[:48], frame[48:])
        return header

    outcomes = {outcome(lambda: parse(impl)) for impl in IMPLS}
    assert len(outcomes) == 1 and outcomes.pop().startswith("FrameError")


header_args = st.tuples(
    st.sampled_from([framing.ACTIVATION, framing.RELEASE, framing.PING,
                     framing.SHUTDOWN]),
    st.sampled_from([0, framing.FLAG_PREFILL, 2, 3, 4, 5]),  # with the codec bits
    st.sampled_from(sorted(framing.ITEMSIZE)),
    st.lists(st.tuples(st.integers(0, U32), st.integers(0, framing.MAX_POSITION),
                       st.booleans()), max_size=20),
    st.integers(0, U32),
    st.lists(st.integers(0, U32), max_size=4),
    st.integers(0, U32),
    st.sampled_from([0, 0, 1, 7, 255]), st.booleans(),  # exit_depth, eligible flags given
)


@FAST
@given(args=header_args)
@example(args=(1, 2, 0, [], 0, [2717, 2719, 459585, 1358298], 0, 0, False))  # fp16: fits
@example(args=(1, 0, 0, [], 0, [0, 179373, 3771575, 6816790], 0, 0, False))  # empty, too wide
def test_twins_pack_identical_bytes(args: Any) -> None:  # coded, not whole
    msg_type, flags, dtype, table, n_tokens, shape, seq, exit_depth, flagged = args
    ids, positions, eligible = ([row[k] for row in table] for k in range(3))
    eligible = eligible if flagged else []
    call = (msg_type, flags, dtype, ids, positions, n_tokens, shape, seq, exit_depth, eligible)
    packed = {outcome(lambda: impl.pack_header(*call)) for impl in IMPLS}
    assert len(packed) == 1
    if packed.pop().startswith("FrameError"):  # a byte count over 64 bits, or a bad early exit
        return
    frame = IMPLS[0].pack_header(*call)
    expected_crc = zlib.crc32(frame[48:], zlib.crc32(frame[:44]))
    assert struct.unpack_from("<I", frame, 44)[0] == expected_crc
    parsed = {outcome(lambda: impl.parse_header(frame[:48], 2 ** 130)) for impl in IMPLS}
    assert len(parsed) == 1
    if parsed.pop().startswith("FrameError"):  # an empty tensor whose other dims span more
        return  # than 64 bits of bytes: packed (no payload), refused on receipt by both twins
    for impl in IMPLS:
        header = impl.parse_header(frame[:48], 2 ** 130)
        impl.parse_table(header, frame[:48], frame[48:])
        assert (header.msg_type, header.flags, header.dtype, header.n_tokens, header.seq) == \
            (msg_type, flags, dtype, n_tokens, seq)
        assert header.sample_ids == tuple(ids) and header.positions == tuple(positions)
        assert header.shape == tuple(shape) and header.exit_depth == exit_depth
        assert header.eligible == (tuple(eligible) if eligible else (False,) * len(ids))


# ------------------------------------------------------------------- selection

def test_select_prefers_the_compiled_module(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = FRAMING.compiled
    if compiled is None:
        pytest.skip("mdiedge.runtime._cframing is not built")
    monkeypatch.delenv("MDIEDGE_NO_EXTENSIONS", raising=False)
    assert FRAMING.select() is compiled
    assert [m.__name__ for m in FRAMING.implementations()] == ["mdiedge.runtime._pyframing",
                                                               "mdiedge.runtime._cframing"]
    monkeypatch.setenv("MDIEDGE_NO_EXTENSIONS", "1")
    assert FRAMING.select().__name__ == "mdiedge.runtime._pyframing"


def test_public_layer_uses_the_selected_module() -> None:
    assert framing._impl is FRAMING.select()
    assert framing.HEADER_SIZE == 48 and framing.MAGIC == b"MDIE"
    for impl in IMPLS:
        types = (impl.ACTIVATION, impl.RELEASE, impl.PING, impl.SHUTDOWN)
        assert types == (1, 2, 3, 5) and impl.MSG_TYPES == types  # 4 is reserved


# ------------------------------------------------------------------- one constants module for both twins

SPEC_NAMES = ("MAGIC", "VERSION", "HEADER_SIZE", "CRC_OFFSET", "ENTRY_SIZE", "MAX_SAMPLES",
              "MAX_NDIM", "MAX_EXIT_DEPTH", "MAX_POSITION", "ELIGIBLE_BIT", "check_eligible",
              "ACTIVATION", "RELEASE", "PING", "SHUTDOWN", "MSG_TYPES", "FLAG_PREFILL",
              "FLAG_CODEC", "FLAGS_KNOWN", "CODEC_SHIFT", "codec_of", "ITEMSIZE", "FrameHeader",
              "byte_view", "check_pack_args", "check_fields", "check_fixed_size",
              "check_table_size", "check_crc", "closed_early")


def test_twins_share_the_spec_objects() -> None:
    """Both implementations hold the spec's very objects: its constants, table and checks."""
    for impl in IMPLS:
        for name in SPEC_NAMES:
            assert getattr(impl, name) is getattr(_framingconstants, name), (impl.__name__, name)
    assert _framingconstants.ITEMSIZE is dtypes.ITEMSIZE
    assert _framingconstants.ITEMSIZE == {d.code: torch.empty((), dtype=getattr(torch, d.name))
                                     .element_size() for d in dtypes.TABLE}


@pytest.mark.parametrize("source", ["ext/_cframing.pyx", "mdiedge/runtime/_pyframing.py"])
def test_no_copy_of_the_spec_in_a_twin(source: str) -> None:
    """Neither twin assigns a name of the spec itself, nor carries its own crc table."""
    path = Path(__file__).resolve().parents[1] / source
    if not path.exists():
        pytest.skip(f"{source} is not in this tree")
    text = path.read_text()
    assert "from mdiedge.runtime._framingconstants import" in text or \
        "from ._framingconstants import" in text
    targets = re.findall(r"^(?:cdef [\w\[\] ]+ )?(\w+(?:\s*,\s*\w+)*)\s*(?:\[[^]]*\])?\s*=(?!=)",
                         text, re.M)  # the names assigned at module level
    assigned = {n.strip() for t in targets for n in t.split(",")} & set(SPEC_NAMES)
    assert not assigned, f"{source} defines {sorted(assigned)} again"
    assert "edb88320" not in text.lower()
