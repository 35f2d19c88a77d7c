"""Hostile GGUF files through the CLI, as issue 45 found them (findings 3 and 10; nested
arrays are tests/test_modelfile.py's): lengths and counts beyond the limits, tensors whose
data overlap or are not aligned, each refused by ``mdiedge generate`` (as ``--model`` and as
``--tokenizer``) with one line naming the key or the tensors and the limit; and megabytes of
numeric metadata cost no more memory than the file without them."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest

from hostile_gguf import (ALIGNMENT, ARRAY, STRING, UINT8, VALID, add_entry, header_size,
                          numeric_array, set_offset, tensor_infos, write)
from mdiedge.base.defaults import GGUF_MAX_ARRAY, GGUF_MAX_KEYS, GGUF_MAX_STRING

ROOT = Path(__file__).resolve().parent.parent
NANOLLAMA = ROOT / "models" / "nanollama"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
Q = "blk.0.attn_q.weight"
OUT = "blk.0.attn_output.weight"  # right before Q in the file's data, as large
V = "blk.0.attn_v.weight"  # right after Q


def _offset(name: str) -> int:
    return tensor_infos(VALID.read_bytes())[name][1]


def _keys(count: int) -> Callable[[bytes], bytes]:
    return lambda data: data[:16] + count.to_bytes(8, "little") + data[24:]


HOSTILE: Dict[str, Tuple[Callable[[bytes], bytes], str]] = {
    "long-array": (lambda d: add_entry(d, "x.many", ARRAY,
                                       numeric_array(GGUF_MAX_ARRAY + 1, UINT8)),
                   f"' holds an array of {GGUF_MAX_ARRAY + 1} "
                   f"entries (at most {GGUF_MAX_ARRAY})"),
    "long-string": (lambda d: add_entry(d, "x.text", STRING,  # its length, no more
                                        struct.pack("<Q", GGUF_MAX_STRING + 1)),
                    f"holds a string of {GGUF_MAX_STRING + 1} bytes (at most "
                    f"{GGUF_MAX_STRING})"),
    "many-keys": (_keys(GGUF_MAX_KEYS + 1),
                  f"the header declares {GGUF_MAX_KEYS + 1} keys (at most {GGUF_MAX_KEYS})"),
    "overlap": (lambda d: set_offset(d, Q, _offset(OUT)),
                f"tensors '{OUT}' and '{Q}' overlap (bytes "),
    "overlap-partly": (lambda d: set_offset(d, Q, _offset(Q) + 32),
                       f"tensors '{Q}' and '{V}' overlap (bytes "),
    "misaligned": (lambda d: set_offset(d, Q, _offset(Q) + 4),
                   f"tensor '{Q}' has its data at offset {_offset(Q) + 4}, not a multiple of "
                   f"the file's alignment 32"),
}


def generate(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mdiedge", "generate", "hi", "-n", "2",
                           "--nodes", "1", "--seed", "1", *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, stdin=subprocess.DEVNULL)


def hostile(tmp_path: Path, case: str) -> Path:
    return write(tmp_path / f"{case}.gguf", HOSTILE[case][0](VALID.read_bytes()))


def one_line(done: subprocess.CompletedProcess, path: Path, message: str) -> None:
    assert done.returncode == 1, done.stderr[-2000:]
    lines: List[str] = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mdiedge: error: {path}: "), lines[:5]
    assert message in lines[0], lines[0]  # after "metadata 'x.key___' (the key padded)"


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_model_file_is_one_line(tmp_path: Path, case: str) -> None:
    path = hostile(tmp_path, case)
    one_line(generate("--model", str(path)), path, HOSTILE[case][1])


@pytest.mark.parametrize("case", ["long-array", "overlap"])
def test_a_hostile_tokenizer_file_is_one_line(tmp_path: Path, case: str) -> None:
    path = hostile(tmp_path, case)
    one_line(generate("--model", str(NANOLLAMA), "--tokenizer", str(path)), path,
             HOSTILE[case][1])


def test_tensors_in_order_with_gaps_still_load(tmp_path: Path) -> None:
    """Aligned regions apart from each other are no overlap: padding between is allowed."""
    data = VALID.read_bytes()
    last, (_, offset) = max(tensor_infos(data).items(), key=lambda item: item[1][1])
    at = header_size(data) + (-header_size(data) % ALIGNMENT) + offset
    moved = set_offset(data, last, offset + 64)
    gap = write(tmp_path / "gap.gguf", moved[:at] + bytes(64) + moved[at:])
    plain, spaced = generate("--model", str(VALID)), generate("--model", str(gap))
    assert spaced.returncode == 0, spaced.stderr[-2000:]
    assert spaced.stdout == plain.stdout


def peak_rss_kb(*args: str) -> int:
    """The peak resident memory of ``mdiedge generate *args`` (it must succeed), in KiB."""
    probe = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], "
             "capture_output=True, text=True); assert done.returncode == 0, done.stderr; "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "mdiedge",
                           "generate", "hi", "-n", "2", "--nodes", "1", "--seed", "1", *args],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_megabytes_of_numeric_metadata_cost_no_memory(tmp_path: Path) -> None:
    """64 MB of metadata arrays no reader asks for (each within the limit): the peak is
    that of the file without them (it was 1 GB, every number a Python object)."""
    data = VALID.read_bytes()
    for i in range(8):
        data = add_entry(data, f"x.numbers{i}", ARRAY, numeric_array(GGUF_MAX_ARRAY))
    heavy = write(tmp_path / "heavy.gguf", data)
    plain_kb, heavy_kb = peak_rss_kb("--model", str(VALID)), peak_rss_kb("--model", str(heavy))
    print(json.dumps({"plain_mb": plain_kb >> 10, "heavy_mb": heavy_kb >> 10}))
    assert heavy_kb < plain_kb + (96 << 10), (plain_kb, heavy_kb)
