"""Greedy speculative decoding equals plain decoding on the ring shapes the other speculation
tests leave out (2 and 4 nodes, 2 and 4 samples, one sample per message, prompt chunks), and
on a real 4-bit model: SmolLM2-135M-Instruct from its GGUF file, one process and a ring of
three."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.engine.opening import EngineSpec, open_engine
from mdiedge.model.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
NANOLLAMA = REPO / "models" / "nanollama"
GREEDY = SamplingParams(temperature=0)
PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "
           "Juliet is the sun.\n")
PROMPT = PASSAGE * 3  # repeats itself: prompt lookup has drafts to offer


def tokens_of(out: Any) -> List[List[int]]:
    return [s["token_ids"] for s in out.samples]


def generate(spec: EngineSpec, prompt: str, n: int, samples: int, micro_batch: int = 0) -> Any:
    with open_engine(spec) as engine:
        return engine.generate(prompt, n, samples, GREEDY, micro_batch=micro_batch)


@pytest.fixture(scope="module")
def plain() -> Dict[int, Any]:
    return {n: generate(EngineSpec(model=NANOLLAMA), PROMPT, 40, n) for n in (2, 4)}


@pytest.mark.parametrize("nodes, samples, micro_batch, chunk", [
    (2, 2, 0, 0),
    (2, 4, 1, 0),  # one sample per message
    (4, 4, 0, 16),  # the prompt in chunks of 16 tokens
    (4, 2, 1, 0),
])
def test_ring_shapes_equal_plain(plain: Dict[int, Any], nodes: int, samples: int,
                                 micro_batch: int, chunk: int) -> None:
    spec = EngineSpec(model=NANOLLAMA, nodes=nodes, speculate="ngram",
                      prefill_chunk=chunk or None)
    out = generate(spec, PROMPT, 40, samples, micro_batch)
    assert tokens_of(out) == tokens_of(plain[samples])
    stats = out.as_dict()["speculation"]
    assert stats["accepted"] > 0 and stats["tokens_per_pass"] > 1.0


def test_smollm2_from_its_gguf_file_equals_plain() -> None:
    """The real model users bring: 4-bit weights, its own tokenizer, a prompt that quotes."""
    prompt = ("Repeat the text.\nText: The quick brown fox jumps over the lazy dog. The quick "
              "brown fox jumps over the lazy dog.\nRepeated: The quick brown fox")
    want = generate(EngineSpec(model="smollm2"), prompt, 24, 1)
    for nodes in (1, 3):
        out = generate(EngineSpec(model="smollm2", nodes=nodes, speculate="ngram"), prompt,
                       24, 1)
        assert tokens_of(out) == tokens_of(want), nodes
        assert out.as_dict()["speculation"]["accepted"] > 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=0.3, top_logprobs=3),
    SamplingParams(temperature=0, repetition_penalty=1.05, logit_bias={13: -100},
                   top_logprobs=0),
])
def test_greedy_with_penalties_and_logprobs_is_the_same_speculating(
        params: SamplingParams) -> None:
    """Penalties apply before the argmax at every verified position (a draft counted as
    output for the positions after it); logprobs are those of each emitted token's row."""
    def run(speculate: Any) -> Any:
        with open_engine(EngineSpec(model=NANOLLAMA, speculate=speculate)) as engine:
            generation = engine.new_generation(PROMPT, 40, 2, params)
            engine.run(generation)
            return generation

    plain, spec = run(None), run("ngram")
    assert [s.tokens for s in spec.samples] == [s.tokens for s in plain.samples]
    assert spec.speculation.stats.accepted > 0
    for a, b in zip(plain.samples, spec.samples):
        assert len(a.logprobs) == len(a.tokens) and [x.token for x in b.logprobs] == b.tokens
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
