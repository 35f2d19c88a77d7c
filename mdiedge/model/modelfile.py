"""The model a process reads, opened once: ``model_file(path)`` is this process's ``ModelFile`` of a
GGUF file, llama2.c file or Hugging Face directory, kept while its files are unchanged (size,
mtime). Its facts (config, a GGUF file's one reader and what is built from it, the content hash) are
read when first asked for and kept, so a process parses a GGUF header once and hashes a model at
most once (``reads`` counts both for a node's status)."""
from __future__ import annotations

import struct
import threading
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple, TypeVar, Union

from ..base.errors import CheckpointError, ConfigError
from .config import ModelConfig, read_json
from .families import config_from_hf
from .gguf import HEADERS_PARSED, config_of, looks_like_gguf, metadata, open_reader, string_array

PathLike = Union[str, Path]
T = TypeVar("T")
LLAMA2C_HEADER = struct.Struct("<7i")  # dim, hidden, layers, heads, kv heads, vocab, context
KEPT = 4  # the files whose ModelFile a process keeps: a model, its draft, a tokenizer's file
CLASSIFIER_FILE = "exit_classifier.safetensors"  # beside a model, not part of its identity
HASHES: Counter = Counter()  # content hashes computed by this process, by path
VOCAB_STRINGS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")  # string arrays to decode


def identity_files(path: Path) -> List[Path]:
    """The file, or a directory's config.json and weight files (not the exit classifier)."""
    if path.is_file():
        return [path]
    return sorted(f for f in path.iterdir() if f.is_file() and (
        f.name in ("config.json", "pytorch_model.bin", "model.safetensors.index.json")
        or f.suffix == ".safetensors" and f.name != CLASSIFIER_FILE))


def _stamp(path: Path) -> Tuple[Tuple[str, int, int], ...]:
    files = identity_files(path)
    if not path.is_file() and (path / "generation_config.json").is_file():
        files.append(path / "generation_config.json")
    stats = [(f.name, f.stat()) for f in files]
    return tuple((name, s.st_size, s.st_mtime_ns) for name, s in stats)


def llama2c_config(path: Path) -> ModelConfig:
    with open(path, "rb") as f:
        raw = f.read(LLAMA2C_HEADER.size)
    if len(raw) < LLAMA2C_HEADER.size:
        raise CheckpointError(f"{path}: truncated llama2.c header ({len(raw)} bytes)")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = LLAMA2C_HEADER.unpack(raw)
    try:
        return ModelConfig(
            name=path.stem, vocab_size=abs(vocab), dim=dim, n_layers=layers, n_heads=heads,
            n_kv_heads=kv_heads, intermediate_size=hidden, max_seq_len=seq_len,
            tie_embeddings=vocab > 0, rms_norm_eps=1e-5, rope_theta=10000.0, bos_id=1,
            eos_ids=(2,))
    except ConfigError as e:
        raise CheckpointError(f"{path}: not a llama2.c checkpoint ({e})") from None


def hf_config(path: Path) -> ModelConfig:
    """With its generation config."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: file not found (is {path} a Hugging Face model "
                              f"directory?)")
    gen_file = path / "generation_config.json"
    generation = read_json(gen_file) if gen_file.exists() else None
    return config_from_hf(read_json(cfg_file), str(cfg_file), generation, str(gen_file))


class ModelFile:
    """Each fact read when first asked for and kept (``memo``); an error is not kept."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_gguf = path.is_file() and looks_like_gguf(path)
        self._memo: Dict[str, Any] = {}
        self._lock = threading.RLock()  # one build at a time: each is built once

    def memo(self, key: str, build: Callable[[], T]) -> T:
        """So what readers derive (tokenizer, tensor index) is built once per process too."""
        with self._lock:
            if key not in self._memo:
                self._memo[key] = build()
            return self._memo[key]

    @property
    def reader(self) -> Any:
        if not self.is_gguf:
            raise CheckpointError(f"{self.path}: not a GGUF file")
        return self.memo("reader", lambda: open_reader(self.path))

    @property
    def cfg(self) -> ModelConfig:
        return self.memo("config", self._config)

    def _config(self) -> ModelConfig:
        if self.is_gguf:
            return config_of(self.reader, self.path)
        return llama2c_config(self.path) if self.path.is_file() else hf_config(self.path)

    @property
    def tensors(self) -> Dict[str, Any]:
        """gguf's ``ReaderTensor``s by their names in the file."""
        return self.memo("tensors", lambda: {t.name: t for t in self.reader.tensors})

    @property
    def vocab(self) -> Dict[str, Any]:
        """The metadata with the vocabulary's string arrays read, what ``gguf_vocab`` builds from;
        not kept (tens of MB of strings), what is built from it is."""
        found = metadata(self.reader)
        for key in VOCAB_STRINGS:
            if key in self.reader.fields:
                try:
                    found[key] = string_array(self.reader, key)
                except CheckpointError:  # not strings: the tokenizer's own error names it
                    pass
        return found

    def content_hash(self) -> str:
        """sha256 (hex) over ``identity_files``, each's name then bytes."""
        return self.memo("hash", self._hash)

    def _hash(self) -> str:
        import hashlib  # OpenSSL's library: memory a run that hashes nothing need not hold

        HASHES[str(self.path)] += 1
        digest = hashlib.sha256()
        for f in identity_files(self.path):
            digest.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()


_OPEN: "OrderedDict[Tuple[str, Tuple[Tuple[str, int, int], ...]], ModelFile]" = OrderedDict()
_OPEN_LOCK = threading.Lock()


def model_file(path: PathLike) -> ModelFile:
    """The one opened before while its files are unchanged; OSError for a path that does not exist.
    """
    path = Path(path)
    key = (str(path.resolve()), _stamp(path))
    with _OPEN_LOCK:
        found = _OPEN.get(key)
        if found is None:
            found = _OPEN[key] = ModelFile(path)
            while len(_OPEN) > KEPT:
                _OPEN.popitem(last=False)
        _OPEN.move_to_end(key)
    return found


def reads() -> Dict[str, int]:
    """GGUF headers parsed and model contents hashed so far."""
    return {"gguf_headers": sum(HEADERS_PARSED.values()), "hashes": sum(HASHES.values())}

