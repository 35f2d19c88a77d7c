"""Drafters (``mdiedge.runtime.drafting``, ``mdiedge.runtime.draftmodel``): prompt lookup by
table, the ``--speculate`` spellings, and the draft model proposing its own greedy
continuation whatever it held before (KV rows past the common prefix overwritten), carrying
its distributions when sampling, and leaving nothing behind a released sample."""
from __future__ import annotations

from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

from mdiedge.base.errors import ConfigError
from mdiedge.model.checkpoint import load_config, load_model
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.draftmodel import DraftModel, DraftModelDrafter
from mdiedge.runtime.drafting import NgramDrafter, parse_speculate
from mdiedge.runtime.speculation import drafter_for

REPO = Path(__file__).resolve().parent.parent
DRAFT = REPO / "models" / "nanollama-draft"
TARGET = REPO / "models" / "nanollama"


@pytest.mark.parametrize("tokens, k, max_n, out", [
    ([1, 2, 3, 4, 1, 2], 3, 3, [3, 4, 1]),  # "1 2" seen before: what followed it
    ([1, 2, 3, 4, 1, 2], 1, 3, [3]),
    ([1, 2, 3, 4, 1, 2], 9, 3, [3, 4, 1, 2]),  # at most up to the end of the text
    ([1, 2, 3, 1, 9, 2, 3], 2, 3, [1, 9]),  # "2 3" (longest) beats the later "3"
    ([5, 1, 7, 1, 8, 1], 2, 3, [8, 1]),  # "1" alone: its latest earlier occurrence
    ([1, 2, 3, 4], 3, 3, []),  # nothing repeats
    ([4, 4], 2, 3, [4]),
    ([1, 2, 3, 1, 2], 0, 3, []),  # k = 0: nothing asked
    ([7], 3, 3, []),
    ([1, 2, 3, 9, 2, 3], 2, 1, [9, 2]),  # max_n 1: only "3" is looked up
])
def test_ngram_proposes_what_followed_the_last_tokens(tokens: List[int], k: int, max_n: int,
                                                      out: List[int]) -> None:
    assert NgramDrafter(max_n=max_n).propose(0, tokens, k).tokens == out


def test_ngram_index_grows_with_the_sample_and_is_released() -> None:
    drafter = NgramDrafter()
    text = [1, 2, 3, 4]
    assert drafter.propose(7, text, 2).tokens == []
    text += [1, 2]  # the sample grew: the new n-grams are found
    assert drafter.propose(7, text, 2).tokens == [3, 4]
    assert drafter.propose(8, [9, 9, 9], 2).tokens == [9]  # another sample, its own text
    drafter.release(7)
    assert drafter.samples == 1
    assert drafter.propose(8, [5, 6], 2).tokens == []  # a reused id with a shorter text
    drafter.release(8)
    assert drafter.samples == 0


def test_ngram_refuses_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="n-gram sizes 3..2"):
        NgramDrafter(max_n=2, min_n=3)


@pytest.mark.parametrize("spec, parsed", [("ngram", ("ngram", "")), ("ngram:4", ("ngram", "4")),
                                          ("draft:models/x", ("draft", "models/x"))])
def test_speculate_spellings(spec: str, parsed: tuple) -> None:
    assert parse_speculate(spec) == parsed


@pytest.mark.parametrize("spec", ["", "lookup", "ngram:0", "ngram:x", "draft:", "draft"])
def test_bad_speculate_spellings_are_quoted(spec: str) -> None:
    with pytest.raises(ConfigError, match=f"speculate {spec!r}"):
        parse_speculate(spec)


def greedy_continuation(path: Path, tokens: List[int], k: int) -> List[int]:
    """The draft model's own greedy continuation, recomputed from scratch without a cache."""
    model = load_model(path)
    out = list(tokens)
    with torch.inference_mode():
        for _ in range(k):
            logits = model(torch.tensor([out]), torch.empty(0, dtype=torch.long), (0,),
                           all_logits=True)
            out.append(int(logits[0, -1].argmax()))
    return out[len(tokens):]


def test_the_draft_model_proposes_its_greedy_continuation_after_any_history() -> None:
    greedy = SamplingParams(temperature=0)
    drafter = drafter_for(f"draft:{DRAFT}", load_config(TARGET), 2, 256, greedy)
    assert isinstance(drafter, DraftModelDrafter)
    text = [1, 827, 2007, 3, 2026, 323, 380]
    first = drafter.propose(5, text, 4)
    assert first.q is None and first.tokens == greedy_continuation(DRAFT, text, 4)
    # the target kept two drafts and chose another token: the rows past them are redone
    text = text + first.tokens[:2] + [(first.tokens[2] + 1) % 2048]
    again = drafter.propose(5, text, 3).tokens
    assert again == greedy_continuation(DRAFT, text, 3)
    assert drafter.propose(6, text, 3).tokens == again  # a fresh sample agrees
    drafter.release(5)
    drafter.release(6)
    assert drafter.samples == 0


def test_the_draft_model_carries_its_distributions_when_sampling() -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=1.0, seed=3)
    drafter = DraftModel(load_model(DRAFT), 1, 128).drafter(params)
    proposal = drafter.propose(0, [1, 827, 2007], 3)
    assert proposal.q is not None and proposal.q.shape == (3, 2048)
    assert np.allclose(proposal.q.sum(-1), np.ones(3))
    assert all(int((row > 0).sum()) <= 20 for row in proposal.q)  # after top-k
    assert all(float(proposal.q[i, t]) > 0 for i, t in enumerate(proposal.tokens))
    drafter.release(0)
    again = DraftModel(load_model(DRAFT), 1, 128).drafter(params).propose(0, [1, 827, 2007], 3)
    assert again.tokens == proposal.tokens  # a seed repeats


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="vocabulary 96 .* is not the target's 2048"):
        drafter_for(f"draft:{tiny_llama}", load_config(TARGET), 1, 64, SamplingParams())
