"""Golden greedy output of the one real pretrained checkpoint (llama2.c format)."""
from __future__ import annotations

from pathlib import Path

from mdiedge.engine.local import LocalEngine
from mdiedge.model.sampling import SamplingParams

GOLDEN = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def test_greedy_from_bos(stories: Path) -> None:
    engine = LocalEngine(stories / "stories260K.bin", tokenizer=stories / "tok512.model")
    out = engine.generate("", 40, params=SamplingParams(temperature=0))
    assert out.samples[0]["text"].startswith(GOLDEN)
    assert out.prompt_ids == [1]


def test_seeded_sampling_is_reproducible_and_independent_of_grouping(stories: Path) -> None:
    engine = LocalEngine(stories / "stories260K.bin", tokenizer=stories / "tok512.model")
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=7)
    together = engine.generate("Once upon", 30, n_samples=3, params=params)
    one_by_one = engine.generate("Once upon", 30, n_samples=3, params=params, micro_batch=1)
    assert [s["token_ids"] for s in together.samples] == [s["token_ids"] for s in one_by_one.samples]
    assert len({tuple(s["token_ids"]) for s in together.samples}) > 1  # samples differ
    again = engine.generate("Once upon", 30, n_samples=3, params=params)
    assert [s["token_ids"] for s in again.samples] == [s["token_ids"] for s in together.samples]


def test_tokenizer_round_trip(stories: Path) -> None:
    from mdiedge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(stories / "stories260K.bin", stories / "tok512.model")
    text = "Lily saw a big dog. It was happy!"
    assert tok.decode(tok.encode(text)) == text
