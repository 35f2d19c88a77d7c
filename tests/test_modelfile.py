"""The model file opened once (``mdiedge.model.modelfile``): a GGUF file's header is parsed
once per process and its contents hashed at most once, in one process and on each node of a
3-node ring, counted where any code would parse (gguf's ``GGUFReader``) or hash (a sha256 fed
the whole file); the kept ModelFile follows the file's changes; metadata arrays nested in
arrays, however deep, are one line, never a traceback."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import pytest

from commands import MDIEDGE
from conftest import make_hf_llama
from gguf_files import write_gguf
from mdiedge.base.errors import CheckpointError, TokenizerError
from mdiedge.engine.opening import EngineSpec, open_engine
from mdiedge.model import modelfile
from mdiedge.model.checkpoint import content_hash, load_config
from mdiedge.model.modelfile import model_file
from mdiedge.model.sampling import SamplingParams
from mdiedge.model.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parent.parent
NANOLLAMA = ROOT / "models" / "nanollama"
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: Any) -> Path:
    folder = tmp_path_factory.mktemp("modelfile")
    hf = make_hf_llama(folder / "hf", seed=5, intermediate_size=64)
    return write_gguf(folder / "tiny.gguf", hf, "Q8_0")


@pytest.fixture
def fresh(tiny_gguf: Path, tmp_path: Path) -> Path:
    """A copy of the tiny file this process has not opened yet."""
    return Path(shutil.copy(tiny_gguf, tmp_path / "fresh.gguf"))


class _Sha256:
    """hashlib.sha256 that keeps how many bytes it was fed."""

    made: List["_Sha256"] = []

    def __init__(self, data: bytes = b"", **kwargs: Any) -> None:
        self.inner = _REAL_SHA256(data, **kwargs)
        self.fed = len(data)
        self.made.append(self)

    def update(self, data: bytes) -> None:
        self.fed += len(data)
        self.inner.update(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_REAL_SHA256 = hashlib.sha256


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Dict[str, Any]:
    """From now on in this process: the GGUF headers parsed (gguf.GGUFReader constructed,
    by whichever code) by file, and the sha256 objects made."""
    parsed: Dict[str, int] = {}
    init = gguf.GGUFReader.__init__

    def counting(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        key = str(Path(path).resolve())
        parsed[key] = parsed.get(key, 0) + 1
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    monkeypatch.setattr(_Sha256, "made", [])
    monkeypatch.setattr(hashlib, "sha256", _Sha256)
    return {"parsed": parsed, "hashes": _Sha256.made}


def _parses(counted: Dict[str, Any], path: Path) -> int:
    return counted["parsed"].get(str(path.resolve()), 0)


def _whole_file_hashes(counted: Dict[str, Any], path: Path) -> int:
    return sum(h.fed >= path.stat().st_size for h in counted["hashes"])


def test_one_process_parses_the_header_once(fresh: Path, counted: Dict[str, Any]) -> None:
    """Text side (config, tokenizer, chat template), the checks, the load, a generation and
    the status: one parse, no hash (nothing asks for one on one node)."""
    from mdiedge.serving.api.chat import ChatTemplate

    before = modelfile.reads()
    engine = open_engine(EngineSpec(model=fresh, nodes=1))
    try:
        out = engine.generate("hello", 4, 1, GREEDY)
        ChatTemplate.for_model(engine.path, engine.tokenizer)
        status = engine.status()
    finally:
        engine.close()
    assert len(out.samples[0]["token_ids"]) == 4
    assert _parses(counted, fresh) == 1
    assert _whole_file_hashes(counted, fresh) <= 1
    assert status[0].file_reads["gguf_headers"] == before["gguf_headers"] + 1


def test_each_node_of_a_ring_parses_once(fresh: Path, counted: Dict[str, Any]) -> None:
    """A local 3-node ring: the starter (this process) and each worker (its status, counted
    in its own process) parse the header once and hash the file at most once."""
    engine = open_engine(EngineSpec(model=fresh, nodes=3))
    try:
        out = engine.generate("hello", 4, 1, GREEDY)
        statuses = engine.status()
    finally:
        engine.close()
    assert len(out.samples[0]["token_ids"]) == 4
    assert _parses(counted, fresh) == 1
    assert _whole_file_hashes(counted, fresh) <= 1
    workers = [s for s in statuses if s.role == "worker"]
    assert len(workers) == 2
    for status in workers:
        assert status.file_reads["gguf_headers"] == 1, status.name
        assert status.file_reads["hashes"] <= 1, status.name


def test_the_kept_file_follows_changes(fresh: Path, counted: Dict[str, Any]) -> None:
    first = model_file(fresh)
    assert model_file(fresh) is first and load_config(fresh) is first.cfg
    assert content_hash(fresh) == content_hash(fresh)
    assert _whole_file_hashes(counted, fresh) == 1 and _parses(counted, fresh) == 1
    os.utime(fresh, ns=(1, 1))  # the same bytes, another modification time: opened anew
    assert model_file(fresh) is not first and load_config(fresh) == first.cfg
    assert _parses(counted, fresh) == 2


def test_a_directory_is_kept_too(tmp_path: Path, counted: Dict[str, Any]) -> None:
    """A Hugging Face directory: its config read and its contents hashed once while its
    files are unchanged; a changed config.json is read again."""
    hf = make_hf_llama(tmp_path / "hf", seed=2, intermediate_size=64)
    first = model_file(hf)
    assert load_config(hf) is first.cfg and model_file(hf) is first
    assert content_hash(hf) == content_hash(hf) == first.content_hash()
    weights = (hf / "model.safetensors").stat().st_size
    assert sum(h.fed >= weights for h in counted["hashes"]) == 1
    config = (hf / "config.json").read_text()
    changed = config.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06')
    (hf / "config.json").write_text(changed)
    assert model_file(hf) is not first and load_config(hf).rms_norm_eps == 1e-6


def _nested(path: Path, depth: int) -> Path:
    """A GGUF file whose one metadata value is arrays nested ``depth`` deep (an empty uint8
    array innermost), written by hand: gguf's writer recurses as its reader does."""
    array, uint8 = 9, 0
    key = b"general.nested"
    body = struct.pack("<Q", len(key)) + key + struct.pack("<I", array)
    body += struct.pack("<IQ", array, 1) * (depth - 1) + struct.pack("<IQ", uint8, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + body)
    return path


@pytest.mark.parametrize("depth", [2, 440, 5000])
def test_nested_arrays_are_one_line(tmp_path: Path, depth: int) -> None:
    path = _nested(tmp_path / f"nested{depth}.gguf", depth)
    message = (f"{path}: metadata 'general.nested' holds an array of arrays (GGUF nests none; "
               f"llama.cpp refuses them)")
    with pytest.raises(CheckpointError) as e:
        load_config(path)
    assert str(e.value) == message
    with pytest.raises(TokenizerError) as t:
        load_tokenizer(NANOLLAMA, path)
    assert str(t.value) == message


def test_nested_arrays_through_the_cli(tmp_path: Path) -> None:
    path = _nested(tmp_path / "nested.gguf", 5000)
    for model in (["--model", str(path)], ["--model", str(NANOLLAMA), "--tokenizer", str(path)]):
        done = subprocess.run([*MDIEDGE, "generate", *model, "hi", "-n", "1", "--nodes", "1"],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 1
        assert done.stderr.splitlines() == [
            f"mdiedge: error: {path}: metadata 'general.nested' holds an array of arrays (GGUF "
            f"nests none; llama.cpp refuses them)"], \
            done.stderr


def test_a_long_metadata_array_stays_a_view_of_the_map() -> None:
    """A vocabulary-sized numeric array is a list at each read, not kept as Python objects
    (8 MiB for 262,144 scores); a short one is made a list once and kept."""
    import numpy as np

    from mdiedge.model.gguf import KEPT_ARRAY, Metadata

    meta = Metadata()
    meta["long"] = np.arange(KEPT_ARRAY + 1, dtype=np.float32)
    meta["short"] = np.arange(3, dtype=np.int32)
    assert meta["long"] == meta["long"] == [float(i) for i in range(KEPT_ARRAY + 1)]
    assert meta["long"] is not meta["long"]
    assert meta["short"] == [0, 1, 2] and meta["short"] is meta["short"]
