"""The bounds of a GGUF header, checked while ``gguf``'s reader parses it: ``GGUF_MAX_*`` on
entries, lengths and header bytes, and tensors whose data lie inside the file, aligned, not
overlapping (llama.cpp lays each at the aligned end of the one before). A failed check is one
CheckpointError, the file named by ``open_reader``."""
from __future__ import annotations

import math
from typing import Any, List, NamedTuple, Optional, Set

import numpy as np

from ..base.defaults import (GGUF_MAX_ARRAY, GGUF_MAX_DIMS, GGUF_MAX_HEADER, GGUF_MAX_KEYS,
                             GGUF_MAX_STRING, GGUF_MAX_TENSORS)
from ..base.errors import CheckpointError

VALUE_STRING, VALUE_ARRAY = 8, 9  # GGUF's value types (gguf.GGUFValueType)


def out_of_file(start: int, end: int, size: int) -> CheckpointError:
    return CheckpointError(f"truncated GGUF file, or an offset beyond its end (bytes "
                           f"{start}..{end} asked for, the file has {size})")


def check_count(count: int, what: str) -> None:
    """``what``: "keys" or tensors."""
    limit = GGUF_MAX_KEYS if what == "keys" else GGUF_MAX_TENSORS
    if int(count) > limit:
        raise CheckpointError(f"the header declares {int(count)} {what} (at most {limit})")


def header_limit(end: int) -> Optional[str]:
    """What breaks the limits in a header running to byte ``end``, or None."""
    return f"the header passes {GGUF_MAX_HEADER} bytes (it runs to byte {end} at least)" \
        if end > GGUF_MAX_HEADER else None


def key_limit(size: int, index: int) -> Optional[str]:
    """What breaks the limits in entry ``index`` (key of ``size`` bytes), or None."""
    return f"metadata entry {index} has a key of {size} bytes (at most {GGUF_MAX_STRING})" \
        if size > GGUF_MAX_STRING else None


def value_limit(reader: Any, offs: int, kind: int, key: str) -> Optional[str]:
    """What breaks the limits in the value at ``offs`` (a string's length, an array's entries, an
    array of arrays), or None; lengths read by the reader's bounds-checked ``_get``."""
    if kind == VALUE_STRING:
        size = int(reader._get(offs, np.uint64)[0])
        found = f"a string of {size} bytes (at most {GGUF_MAX_STRING})" \
            if size > GGUF_MAX_STRING else None
    elif kind == VALUE_ARRAY:
        item = int(reader._get(offs, np.uint32)[0])
        count = int(reader._get(offs + 4, np.uint64)[0])
        found = "an array of arrays (GGUF nests none; llama.cpp refuses them)" \
            if item == VALUE_ARRAY else f"an array of {count} entries (at most " \
            f"{GGUF_MAX_ARRAY})" if count > GGUF_MAX_ARRAY else None
    else:
        found = None
    return None if found is None else f"metadata {key!r} holds {found}"


def check_header(end: int) -> None:
    limit = header_limit(end)
    if limit is not None:
        raise CheckpointError(limit)


def check_tensor_info(field: Any, known: Set[int]) -> None:
    """A ggml type of ``known``, at most ``GGUF_MAX_DIMS`` dimensions."""
    name = bytes(field.parts[1]).decode("utf-8", "replace")
    kind, dims = int(field.parts[4][0]), len(field.parts[3])
    if kind not in known:
        raise CheckpointError(f"tensor {name!r} has an unknown ggml type {kind}")
    if dims > GGUF_MAX_DIMS:
        raise CheckpointError(f"tensor {name!r} has {dims} dimensions (at most {GGUF_MAX_DIMS})")


class Region(NamedTuple):
    """Bytes [start, end) of a tensor's data."""

    name: str
    start: int
    end: int


def tensor_region(gguf: Any, field: Any, data_start: int, alignment: int,
                  file_size: int) -> Region:
    """Checked: whole blocks per row, offset a multiple of ``alignment``, inside the file."""
    name = bytes(field.parts[1]).decode("utf-8", "replace")
    dims = [int(d) for d in field.parts[3]]
    kind = gguf.GGMLQuantizationType(int(field.parts[4][0]))
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    if dims and dims[0] % block:
        raise CheckpointError(f"tensor {name!r} has rows of {dims[0]} values, not whole "
                              f"{kind.name} blocks of {block}")
    offset = int(field.parts[5][0])
    if offset % alignment:
        raise CheckpointError(f"tensor {name!r} has its data at offset {offset}, not a "
                              f"multiple of the file's alignment {alignment}")
    start = data_start + offset
    end = start + math.prod(dims) // block * block_bytes
    if end > file_size:
        raise CheckpointError(f"truncated GGUF file, or an offset beyond its end (tensor "
                              f"{name!r} at bytes {start}..{end}, the file has {file_size})")
    return Region(name, start, end)


def check_overlaps(regions: List[Region]) -> None:
    furthest: Optional[Region] = None  # of the regions before, the one that ends last
    for region in sorted((r for r in regions if r.end > r.start), key=lambda r: r.start):
        if furthest is not None and region.start < furthest.end:
            raise CheckpointError(
                f"tensors {furthest.name!r} and {region.name!r} overlap (bytes "
                f"{furthest.start}..{furthest.end} and {region.start}..{region.end})")
        if furthest is None or region.end > furthest.end:
            furthest = region
