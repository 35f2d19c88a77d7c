"""Shared fixtures: tiny random Hugging Face Llama checkpoints and the stories260K files."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

REPO = Path(__file__).resolve().parent.parent
# stories260K (about 1 MB, MIT): the in-repository copy is the default; the workspace's shared
# model store is only a fallback for checkouts that predate the copy.
STORIES = REPO / "tests" / "data" / "stories260k"
STORIES_FALLBACK = REPO.parent / "shared" / "models" / "stories260k"
STORIES_FILES = ("stories260K.bin", "tok512.model")


def stories_dir() -> Path:
    """The folder holding stories260K.bin and tok512.model: tests/data/stories260k, else
    ../shared/models/stories260k; skips (naming both) when neither has both files."""
    for path in (STORIES, STORIES_FALLBACK):
        if all((path / name).is_file() for name in STORIES_FILES):
            return path
    pytest.skip(f"stories260K files {', '.join(STORIES_FILES)} not found in {STORIES} "
                f"(see its README.md) nor in {STORIES_FALLBACK}")


def pytest_configure(config: Any) -> None:
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


class FakeEngine:
    """Stands in for ``RingEngine``: keeps what it was given, sets nothing up."""

    made: List["FakeEngine"] = []

    def __init__(self, workers: Any, model: Any = None, tokenizer: Any = None,
                 options: Any = None, **changes: Any) -> None:
        self.options, self.changes = options, changes
        FakeEngine.made.append(self)

    def close(self) -> None:
        pass


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> List[FakeEngine]:
    """``RingEngine`` replaced by ``FakeEngine``; the engines made, in order."""
    import mdiedge.roles.starter as starter_module

    FakeEngine.made = []
    monkeypatch.setattr(starter_module, "RingEngine", FakeEngine)
    return FakeEngine.made
