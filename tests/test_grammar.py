"""Grammars for constrained decoding: compiled against SmolLM2's vocabulary, the tokens they
allow, a walk that always takes the most likely allowed token of random logits ending in
valid JSON, and every hostile or broken grammar a one-line ``GrammarError`` within a
second."""
from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from mdiedge.base import defaults  # noqa: E402
from mdiedge.base.errors import GenerationError  # noqa: E402
from mdiedge.model.grammar import Grammar, GrammarError  # noqa: E402
from mdiedge.model.tokenizer import load_tokenizer  # noqa: E402
from smollm2 import gguf_file  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(gguf_file())


def walk(grammar: Grammar, tokenizer: Any, seed: int, steps: int = 80) -> str:
    """Greedy over random logits under ``grammar`` until it ends (or EOS)."""
    constraint, ids = grammar.matcher(), []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        token = int(constraint.mask(torch.randn(grammar.vocab_size, generator=generator)).argmax())
        if token == tokenizer.eos_id:
            break
        constraint.take([token])
        ids.append(token)
        if constraint.finished:
            break
    return tokenizer.decode(ids)


def test_json_object_allows_only_an_opening_brace_first(tokenizer: Any) -> None:
    allowed = Grammar(tokenizer, 49152, "json_object", None).matcher().allowed()
    assert allowed.dtype == np.bool_ and allowed.shape == (49152,)
    assert {tokenizer.token(i) for i in np.flatnonzero(allowed).tolist()} == \
        {"{", "{}", '{"'}


@pytest.mark.parametrize("seed", range(5))
def test_a_walk_under_a_schema_is_valid_json_of_that_schema(tokenizer: Any, seed: int) -> None:
    text = walk(Grammar(tokenizer, 49152, "json_schema", PERSON), tokenizer, seed, steps=200)
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


@pytest.mark.parametrize("kind, source, pattern", [
    ("regex", r"(yes|no)", r"^(yes|no)$"),
    ("gbnf", 'root ::= "red" | "green" | "blue"', r"^(red|green|blue)$"),
    ("lark", 'start: "A" DIGIT DIGIT\nDIGIT: /[0-9]/', r"^A[0-9]{2}$"),
])
def test_grammars_of_each_kind_hold_the_output(tokenizer: Any, kind: str, source: str,
                                                pattern: str) -> None:
    import re

    for seed in range(3):
        assert re.match(pattern, walk(Grammar(tokenizer, 49152, kind, source), tokenizer, seed))


def test_a_refused_token_is_a_generation_error(tokenizer: Any) -> None:
    constraint = Grammar(tokenizer, 49152, "regex", "abc").matcher()
    with pytest.raises(GenerationError, match="grammar: .*doesn't satisfy the grammar"):
        constraint.take(tokenizer.encode("xyz"))


def deep_schema(depth: int) -> Any:
    schema: Any = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("kind, source, message", [
    ("json_schema", deep_schema(40), "nested deeper than"),
    ("json_schema", {"type": "string", "pattern": "x" * (defaults.GRAMMAR_MAX_BYTES + 1)},
     "bytes a grammar may have"),
    ("json_schema", ["not", "an", "object"], "expected a JSON object"),
    ("json_schema", {"type": "no-such-type"}, "json_schema"),
    ("gbnf", "root ::= missing-rule", "gbnf"),
    ("gbnf", 12, "expected a string"),
    ("regex", "(unclosed", "regex"),
    ("lark", "start: (", "lark"),
    ("bnf", "x", "grammar kind 'bnf'"),
])
def test_bad_grammars_are_one_line_errors(tokenizer: Any, kind: str, source: Any,
                                          message: str) -> None:
    started = time.monotonic()
    with pytest.raises(GrammarError) as caught:
        Grammar(tokenizer, 49152, kind, source)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - started < 5


def test_a_sentencepiece_tokenizer_is_refused_in_one_line(stories: Any) -> None:
    piece = load_tokenizer(stories / "stories260K.bin", stories / "tok512.model")
    with pytest.raises(GrammarError, match="needs a Hugging Face tokenizer"):
        Grammar(piece, 512, "json_object", None)


def test_drafts_are_masked_as_the_grammar_stands_after_each(tokenizer: Any) -> None:
    """Row i masked after drafts 0..i-1; a draft outside the grammar leaves the rows after
    it unmasked (never read: verification stops there); the matcher ends where it began."""
    from mdiedge.model.speculative import greedy_accept

    constraint = Grammar(tokenizer, 49152, "gbnf", 'root ::= "red" | "green"').matcher()
    good = tokenizer.encode("green")
    logits = np.zeros((len(good) + 2, 49152), dtype=np.float32)
    rows = constraint.masked_drafts(logits, good + [tokenizer.encode("x")[0]])
    for i, token in enumerate(good):
        assert rows[i, token] == 0 and int((rows[i] == 0).sum()) < 49152
    assert bool(np.isinf(rows[:len(good)]).any())
    assert not bool(np.isinf(rows[len(good) + 1]).any())  # after the refused draft
    assert {tokenizer.token(i) for i in np.flatnonzero(constraint.allowed()).tolist()} >= \
        {tokenizer.token(good[0])}  # back at the start
    bad = tokenizer.encode("blue")
    masked = constraint.masked_drafts(np.zeros((len(bad) + 1, 49152), dtype=np.float32), bad)
    assert np.isinf(masked[0, bad[0]])
    assert greedy_accept(bad, masked.argmax(axis=-1).tolist())[0] != bad[0]
    constraint.take(good)
    assert constraint.finished


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_verified_draft_outside_the_grammar_is_rejected(tokenizer: Any,
                                                          temperature: float) -> None:
    """A step verifying drafts the raw logits favour most: greedy or sampled, the tokens
    kept follow the grammar ("red" or "green"), never the drafted "blue"."""
    from mdiedge.base.request import SamplingParams, ids_request
    from mdiedge.runtime.drafting import Proposal
    from mdiedge.runtime.generation import Generation
    from mdiedge.runtime.speculation import Draft, Speculation

    class NoDrafter:
        def propose(self, sample_id: int, tokens: Any, k: int) -> Proposal:
            return Proposal()

        def release(self, sample_id: int) -> None:
            pass

    params = SamplingParams(temperature, seed=5)
    generation = Generation(ids_request([1, 2, 3], 8, 1, params), ())
    generation.constrain(Grammar(tokenizer, 49152, "gbnf", 'root ::= "red" | "green"'))
    generation.speculation = Speculation(NoDrafter(), params)
    sample, blue = generation.samples[0], tokenizer.encode("blue")
    sample.sid = 7
    logits = torch.zeros(len(blue) + 1, 49152)
    for i, token in enumerate(blue):
        logits[i, token] = 50.0  # the model itself would pick the drafts
    draft = Draft(2, [3] + blue, Proposal(list(blue)))
    generation.settle([sample], logits.unsqueeze(0), {7: draft})
    text = tokenizer.decode(sample.tokens)
    assert sample.tokens and not text.startswith("b") and ("red".startswith(text) or
                                                           "green".startswith(text)), text
