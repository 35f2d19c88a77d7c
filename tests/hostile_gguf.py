"""Hostile GGUF files for the tests, made from a small valid one by splicing bytes: a metadata
entry added at the front of the header (deeply nested arrays, huge lengths, megabytes of
numbers), a tensor's data offset moved (onto another tensor, off the alignment), the file cut
short. Written independently of ``mdiedge.model.gguf``: GGUF's layout as its spec gives it.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Dict, List, Tuple, Union

ROOT = Path(__file__).resolve().parent.parent
VALID = ROOT / "tests" / "data" / "gguf" / "tiny-llama-2x256-Q6_K.gguf"  # alignment 32
ALIGNMENT = 32
HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata entry count
UINT8, UINT32, FLOAT32, STRING, ARRAY, UINT64 = 0, 4, 6, 8, 9, 10  # GGUF value types
TYPE_SIZES = {UINT8: 1, UINT32: 4, FLOAT32: 4, UINT64: 8}
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size types


def gguf_string(text: Union[str, bytes]) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def entry(key: str, kind: int, payload: bytes) -> bytes:
    """One metadata entry: its key, its value type, its value's bytes."""
    return gguf_string(key) + struct.pack("<I", kind) + payload


def nested_array(depth: int) -> bytes:
    """The payload of an array type holding one array, ``depth`` deep, around one uint8."""
    inner = struct.pack("<IQ", UINT8, 1) + b"\x07"
    for _ in range(depth - 1):
        inner = struct.pack("<IQ", ARRAY, 1) + inner
    return inner


def numeric_array(count: int, kind: int = FLOAT32, fill: bytes = b"") -> bytes:
    """An array payload of ``count`` numbers (``fill``: their bytes; else zeros)."""
    body = fill or bytes(count * TYPE_SIZES[kind])
    return struct.pack("<IQ", kind, count) + body


def add_entry(data: bytes, key: str, kind: int, payload: bytes) -> bytes:
    """``data`` (a GGUF file) with the entry added before its first: the key padded so that
    the entry is a whole number of alignments long, which keeps every tensor's data where
    its offset says."""
    pad = -len(entry(key, kind, payload)) % ALIGNMENT
    added = entry(key + "_" * pad, kind, payload)
    magic, version, tensors, entries = HEADER.unpack_from(data)
    return HEADER.pack(magic, version, tensors, entries + 1) + added + data[HEADER.size:]


def length_fields(data: bytes) -> List[int]:
    """Where each 64-bit count of ``data``'s header lies: the tensor and entry counts, every
    string's and array's length, every tensor's dimensions and data offset."""
    found = [8, 16]
    _, _, tensors, entries = HEADER.unpack_from(data)
    pos = HEADER.size
    for _ in range(entries):
        found.append(pos)
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        kind = struct.unpack_from("<I", data, pos)[0]
        pos = _skip_value(data, pos + 4, kind, found)
    for _ in range(tensors):
        found.append(pos)
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        dims = struct.unpack_from("<I", data, pos)[0]
        found.extend(pos + 4 + 8 * i for i in range(dims))  # its dimensions, and
        found.append(pos + 4 + 8 * dims + 4)  # after its type, its offset
        pos += 4 + 8 * dims + 4 + 8
    return sorted(set(found))


def tensor_infos(data: bytes) -> Dict[str, Tuple[int, int]]:
    """Each tensor's name -> (where its data offset field lies in ``data``, the offset)."""
    _, _, tensors, entries = HEADER.unpack_from(data)
    pos = HEADER.size
    for _ in range(entries):
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        pos = _skip_value(data, pos + 4, struct.unpack_from("<I", data, pos)[0], [])
    found = {}
    for _ in range(tensors):
        size = struct.unpack_from("<Q", data, pos)[0]
        name = data[pos + 8:pos + 8 + size].decode()
        dims = struct.unpack_from("<I", data, pos + 8 + size)[0]
        at = pos + 8 + size + 4 + 8 * dims + 4
        found[name] = (at, struct.unpack_from("<Q", data, at)[0])
        pos = at + 8
    return found


def header_size(data: bytes) -> int:
    """Where the header's tensor descriptions end (the data section follows, aligned)."""
    return max(at for at, _ in tensor_infos(data).values()) + 8


def _skip_value(data: bytes, pos: int, kind: int, lengths: List[int]) -> int:
    """The position after the value of ``kind`` at ``pos``; its lengths' places added to
    ``lengths``."""
    if kind == STRING:
        lengths.append(pos)
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", data, pos)
        lengths.append(pos + 4)
        pos += 12
        if item in SIZES:
            return pos + count * SIZES[item]
        for _ in range(count):
            pos = _skip_value(data, pos, item, lengths if item != STRING else [])
            if pos > len(data):
                raise ValueError("an array past the end of the file")
        return pos
    return pos + SIZES[kind]


def set_offset(data: bytes, name: str, offset: int) -> bytes:
    """``data`` with tensor ``name``'s data offset (from the data section's start) set."""
    at = tensor_infos(data)[name][0]
    return data[:at] + struct.pack("<Q", offset) + data[at + 8:]


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
