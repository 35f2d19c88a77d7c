"""Fuzzing (issue 45): the GGUF reader over mutated headers and metadata of a small valid
file, seeded with the probe's hostile cases (deep nesting, huge lengths and counts,
overlapping and misaligned tensors, truncation); and the frame parser, both twins, over
mutated streams of frames (plain, coded, sealed), read through a buffered reader and straight
from the socket. Every outcome is a result or our one-line error (CheckpointError and kin for
a file, FrameError for a frame), never another exception, a hang, or memory out of
proportion. Each test is bounded by its example count (``MDIEDGE_FUZZ_EXAMPLES`` raises it)
to well under a minute; CI runs them with the rest (the frame fuzz again without the
compiled modules, as the twins' tests)."""
from __future__ import annotations

import os
import resource
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hostile_gguf import (ALIGNMENT, ARRAY, FLOAT32, STRING, UINT8, VALID, add_entry, header_size,
                          length_fields, nested_array, numeric_array, set_offset, tensor_infos)
from mdiedge.base.codecs import FP16, INT8, NONE
from mdiedge.base.defaults import GGUF_MAX_ARRAY, GGUF_MAX_KEYS, GGUF_MAX_STRING
from mdiedge.base.errors import FrameError, MdiedgeError
from mdiedge.model import gguf_vocab
from mdiedge.model.gguf import config_of, metadata, open_reader, string_array
from mdiedge.runtime import framing
from mdiedge.runtime.framing import FRAMING
from mdiedge.runtime.seal import derive

EXAMPLES = int(os.environ.get("MDIEDGE_FUZZ_EXAMPLES", "0"))  # 0: each test's own count
SLOW_EXAMPLE_S = 10.0  # one example taking longer is a hang
MEMORY_MB = 64  # growth of this process's peak resident memory, at most: over one fuzz test
#                of frames; over one GGUF example, with four times the file's size
U64 = 2 ** 64 - 1
IMPLS = FRAMING.implementations()


def fuzz_settings(examples: int) -> Any:
    return settings(max_examples=EXAMPLES or examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@pytest.fixture
def bounded_memory() -> Iterator[None]:
    """Once around all the examples of a test: its peak memory grows less than MEMORY_MB."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
    assert grown_mb < MEMORY_MB, f"peak memory grew {grown_mb} MB"


def one_line_or_result(call: Any) -> str:
    """``call()``'s outcome: "ok", or the name of our error (one line); any other exception
    fails the test, and so does an example that takes too long."""
    start = time.monotonic()
    try:
        call()
        found = "ok"
    except MdiedgeError as e:
        assert "\n" not in str(e) and str(e), repr(e)
        found = type(e).__name__
    assert time.monotonic() - start < SLOW_EXAMPLE_S
    return found


# ------------------------------------------------------------------- the GGUF reader

GGUF = VALID.read_bytes()
HEADER_END = header_size(GGUF)
LENGTHS = length_fields(GGUF)
TENSORS = sorted(tensor_infos(GGUF))
EXTREMES = [0, 1, 7, 31, 32, 33, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63, U64, GGUF_MAX_KEYS + 1,
            GGUF_MAX_ARRAY, GGUF_MAX_ARRAY + 1, GGUF_MAX_STRING + 1, len(GGUF), HEADER_END]
ENTRIES = {  # the probe's hostile metadata, added before the file's first entry
    "nested-480": (ARRAY, nested_array(480)),
    "nested-2": (ARRAY, nested_array(2)),
    "long-array": (ARRAY, numeric_array(GGUF_MAX_ARRAY + 1, UINT8)),
    "full-array": (ARRAY, numeric_array(GGUF_MAX_ARRAY, FLOAT32,  # 8 MB of numbers
                                        struct.pack("<f", 0.5) * GGUF_MAX_ARRAY)),
    "claimed-array": (ARRAY, struct.pack("<IQ", UINT8, U64)),
    "claimed-strings": (ARRAY, struct.pack("<IQ", STRING, 2 ** 40)),
    "claimed-string": (STRING, struct.pack("<Q", GGUF_MAX_STRING + 1)),
    "bad-type": (77, b""),
    "bad-item": (ARRAY, struct.pack("<IQ", 99, 1)),
}
CHEAP_ENTRIES = sorted(k for k, (_, payload) in ENTRIES.items() if len(payload) < 4096)
mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, HEADER_END - 1), st.integers(1, 255)),
    st.tuples(st.just("length"), st.sampled_from(LENGTHS),
              st.one_of(st.sampled_from(EXTREMES), st.integers(0, U64))),
    st.tuples(st.just("cut"), st.integers(0, len(GGUF)), st.just(0)),
    st.tuples(st.just("entry"), st.sampled_from(CHEAP_ENTRIES), st.just(0)),
    st.tuples(st.just("offset"), st.sampled_from(TENSORS),
              st.one_of(st.sampled_from(EXTREMES), st.integers(0, len(GGUF)))),
)


def mutated(changes: List[Tuple[str, Any, int]]) -> bytes:
    data = GGUF
    for index, (kind, where, value) in enumerate(changes):
        if kind == "flip" and data:
            at = where % len(data)
            data = data[:at] + bytes([data[at] ^ value]) + data[at + 1:]
        elif kind == "length":
            at = where % max(1, len(data) - 8)
            data = data[:at] + struct.pack("<Q", value) + data[at + 8:]
        elif kind == "cut":
            data = data[:where]
        elif kind == "entry" and len(data) >= 24:
            data = add_entry(data, f"fuzz.{index}.{where}", *ENTRIES[where])
        elif kind == "offset" and where in tensor_infos_or_none(data):
            data = set_offset(data, where, value)
    return data


def tensor_infos_or_none(data: bytes) -> Dict[str, Tuple[int, int]]:
    """The tensors' offsets of a file the mutations before may have made unreadable to the
    test's own walker (then: none, and the offset mutation is left out)."""
    try:
        return tensor_infos(data)
    except (struct.error, UnicodeDecodeError, KeyError, ValueError, OverflowError):
        return {}


def read_header(path: Path) -> None:
    """What a command reads of a GGUF file's header: its config, the vocabulary's strings and
    the chat side; and, where the reader took the file, its tensors' data regions are in the
    file, aligned and apart (as llama.cpp requires)."""
    reader = open_reader(path)
    meta = metadata(reader)
    if "tokenizer.ggml.tokens" in reader.fields:
        meta["tokenizer.ggml.tokens"] = string_array(reader, "tokenizer.ggml.tokens")
    gguf_vocab.read_chat(meta, path)
    regions = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in reader.tensors)
    for (start, end, name), after in zip(regions, regions[1:] + [(path.stat().st_size,) * 3]):
        assert start % reader.alignment == 0 and end <= after[0], (name, start, end, after)
    config_of(reader, path)


def peak_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10


@pytest.mark.slow
@fuzz_settings(1000)
@given(changes=st.lists(mutations, min_size=1, max_size=3))
@example(changes=[("entry", "nested-480", 0)])
@example(changes=[("entry", "long-array", 0)])
@example(changes=[("entry", "full-array", 0)] * 3)  # 24 MB of numbers
@example(changes=[("entry", "claimed-array", 0)])
@example(changes=[("entry", "claimed-strings", 0)])
@example(changes=[("entry", "claimed-string", 0)])
@example(changes=[("length", 16, GGUF_MAX_KEYS + 1)])  # entries declared
@example(changes=[("length", 8, 2 ** 40)])  # tensors declared
@example(changes=[("offset", "blk.0.attn_q.weight", tensor_infos(GGUF)["blk.0.attn_v.weight"][1])])
@example(changes=[("offset", "blk.0.attn_q.weight", ALIGNMENT + 4)])
@example(changes=[("offset", "output_norm.weight", U64 - 31)])
@example(changes=[("cut", HEADER_END // 2, 0)])
@example(changes=[("cut", len(GGUF) - 100, 0)])
def test_mutated_gguf_headers_read_or_fail_in_one_line(
        changes: List[Tuple[str, Any, int]]) -> None:
    data = mutated(changes)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzzed.gguf"
        path.write_bytes(data)
        before = peak_mb()
        one_line_or_result(lambda: read_header(path))
        grown = peak_mb() - before
        assert grown < MEMORY_MB + 4 * (len(data) >> 20), f"peak memory grew {grown} MB"


# ------------------------------------------------------------------- the frame parser

TENSOR_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]
frames = st.lists(st.fixed_dictionaries({
    "msg_type": st.sampled_from([framing.ACTIVATION, framing.RELEASE, framing.PING,
                                 framing.SHUTDOWN]),
    "samples": st.integers(0, 3),
    "shape": st.lists(st.integers(1, 5), min_size=1, max_size=3),
    "dtype": st.sampled_from(TENSOR_TYPES),
    "codec": st.sampled_from([NONE, FP16, INT8]),
    "seq": st.integers(0, 2 ** 32 - 1),
}), min_size=1, max_size=3)
stream_changes = st.lists(st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10 ** 6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10 ** 6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10 ** 6), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("delete"), st.integers(0, 10 ** 6), st.integers(1, 64)),
    st.tuples(st.just("u32"), st.integers(0, 10 ** 6), st.sampled_from(
        [0, 1, 2 ** 16, 2 ** 31, 2 ** 32 - 1])),
    st.tuples(st.just("u64"), st.integers(0, 10 ** 6), st.sampled_from(
        [0, 2 ** 20 + 1, 2 ** 40, 2 ** 63, U64])),
), min_size=1, max_size=3)


def send(sock: socket.socket, frame: Dict[str, Any], sealer: Optional[Any]) -> None:
    ids = list(range(frame["samples"]))
    if frame["msg_type"] in (framing.RELEASE, framing.SHUTDOWN):
        framing.send_control(sock, frame["msg_type"], ids, ids, seq=frame["seq"], sealer=sealer)
        return
    tensor = (torch.randn(frame["shape"]) * 4).to(frame["dtype"])
    framing.send_tensor(sock, frame["msg_type"], ids, ids, tensor, seq=frame["seq"],
                        codec=frame["codec"], sealer=sealer)


def wire(sent: List[Dict[str, Any]], sealer: Optional[Any]) -> bytes:
    a, b = socket.socketpair()
    with a, b:
        for frame in sent:
            send(a, frame, sealer)
        a.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = b.recv(1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def changed(data: bytes, changes: List[Tuple[str, int, Any]]) -> bytes:
    out = bytearray(data)
    for kind, where, value in changes:
        at = where % (len(out) + 1)
        if kind == "flip" and at < len(out):
            out[at] ^= value
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = value
        elif kind == "delete":
            del out[at:at + value]
        elif kind in ("u32", "u64"):
            out[at:at + 4 * (1 + (kind == "u64"))] = struct.pack(
                "<I" if kind == "u32" else "<Q", value)
    return bytes(out)


def receive(impl: ModuleType, data: bytes, source: str, opener: Optional[Any],
            frames_sent: int) -> Tuple[int, str]:
    """The frames received from ``data`` (sent, then the end of the stream) and how the
    receiving ended: only ever a FrameError (the stream's end is one too)."""
    a, b = socket.socketpair()
    b.settimeout(SLOW_EXAMPLE_S / 2)
    writer = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)),
                              daemon=True)
    writer.start()
    got = 0
    try:
        reader: Any = b if source == "socket" else framing.reader(
            b, impl, 0 if source == "unbuffered" else None)
        for _ in range(frames_sent + 8):
            framing.recv_frame(reader, 1 << 20, impl=impl, opener=opener)
            got += 1
        return got, "frames left over"
    except FrameError as e:
        assert "\n" not in str(e)
        return got, "FrameError"
    finally:
        b.close()
        writer.join(SLOW_EXAMPLE_S)
        a.close()


@pytest.mark.twins
@pytest.mark.slow
@fuzz_settings(2500)
@given(sent=frames, changes=stream_changes, sealed=st.booleans(),
       source=st.sampled_from(["reader", "unbuffered", "socket"]))
@example(sent=[dict(msg_type=framing.ACTIVATION, samples=2, shape=[2, 3], dtype=torch.float32,
                    codec=INT8, seq=1)], changes=[("u64", 36, 2 ** 63)], sealed=False,
         source="reader")  # a huge tensor declared
@example(sent=[dict(msg_type=framing.PING, samples=0, shape=[4], dtype=torch.int64, codec=NONE,
                    seq=0)], changes=[("cut", 50, 0)], sealed=True, source="socket")
def test_mutated_frames_are_frame_errors_in_both_twins(
        sent: List[Dict[str, Any]], changes: List[Tuple[str, int, Any]], sealed: bool,
        source: str, bounded_memory: None) -> None:
    sender, receiver = (derive(b"k" * 32, b"c" * 32, b"a" * 32, end) for end in (True, False))
    data = changed(wire(sent, sender.sealer() if sealed else None), changes)
    outcomes = {impl.__name__: receive(impl, data, source,
                                       receiver.opener() if sealed else None, len(sent))
                for impl in IMPLS}
    assert len(set(outcomes.values())) == 1, outcomes  # the twins agree
    assert next(iter(outcomes.values()))[1] == "FrameError"
