"""Speculative sampling through the whole engine (``open_engine``, ``Engine.generate``):
many seeded draws of the first, the second and the fifth generated token of a tiny random
Llama, plain
and speculating with a draft model (another tiny random Llama of the same vocabulary, whose
proposals are often rejected), come from one distribution (chi-square test of homogeneity,
p > 0.01); and a seed gives the same text on one node and on a local ring of three with
speculation on."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest
import torch

from conftest import make_hf_llama, write_tiny_tokenizer
from mdiedge.engine.opening import EngineSpec, open_engine
from mdiedge.model.sampling import SamplingParams
from test_speculative import p_value

PROMPT = "hello ring 1 the quick brown fox jumps hello ring 1 the quick brown fox jumps"
CALLS, SAMPLES = 36, 16  # draws each way: CALLS x SAMPLES
POSITIONS = (0, 1, 4)  # the first (from the prefill), the second (the first verified), the fifth
ENDED = -1  # the sample ended (end of text) before the position


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory: Any) -> Path:
    """A two-block random Llama of ``ring_model``'s vocabulary: another model's guesses."""
    path = make_hf_llama(tmp_path_factory.mktemp("draft-llama"), seed=9, num_hidden_layers=2,
                         max_position_embeddings=256)
    write_tiny_tokenizer(path)
    return path


def token_at(sample: Dict[str, Any], position: int, eos: int) -> int:
    """The sample's token at ``position``: the end-of-text token where it ended there,
    ``ENDED`` where it ended before."""
    ids = sample["token_ids"]
    if position < len(ids):
        return ids[position]
    return eos if position == len(ids) and sample["finish_reason"] == "eos" else ENDED


def draws(model: Path, speculate: Any, params: SamplingParams, seeds: Sequence[int]
          ) -> Tuple[Dict[int, List[int]], Dict[str, int]]:
    """Each seed's SAMPLES draws of the tokens at ``POSITIONS``, and the speculation's
    drafted and accepted tokens summed."""
    out: Dict[int, List[int]] = {p: [] for p in POSITIONS}
    totals = {"drafted": 0, "accepted": 0}
    with open_engine(EngineSpec(model=model, speculate=speculate)) as engine:
        eos = engine.cfg.eos_ids[0]
        for seed in seeds:
            result = engine.generate(PROMPT, max(POSITIONS) + 1, SAMPLES,
                                     SamplingParams(params.temperature, params.top_k,
                                                    params.top_p, seed=seed))
            for sample in result.samples:
                for p in POSITIONS:
                    out[p].append(token_at(sample, p, eos))
            for key in totals:
                totals[key] += (result.speculation or {}).get(key, 0)
    return out, totals


def homogeneity(a: Sequence[int], b: Sequence[int], least: float = 5.0) -> float:
    """p-value that two samples of tokens come from one distribution: a chi-square test of
    the 2 x categories table, categories expected under ``least`` in either row pooled."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[float(x.count(c)) for c in cats] for x in (list(a), list(b))])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = (expected < least).any(0)
    if small.any():
        table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], 1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return p_value(stat, table.shape[1] - 1) if table.shape[1] > 1 else 1.0


def test_homogeneity_tells_one_distribution_from_two() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    q = torch.tensor([0.3, 0.4, 0.2, 0.05, 0.05])

    def draw(probs: torch.Tensor) -> List[int]:
        return torch.multinomial(probs, 600, replacement=True, generator=gen).tolist()

    assert homogeneity(draw(p), draw(p)) > 0.01
    assert homogeneity(draw(p), draw(q)) < 0.01


def test_speculative_sampling_keeps_the_distribution_through_the_engine(
        ring_model: Path, draft_model: Path, one_thread: None) -> None:
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.95)
    plain, _ = draws(ring_model, None, params, range(CALLS))
    spec, totals = draws(ring_model, f"draft:{draft_model}", params,
                         range(1000, 1000 + CALLS))  # independent of the plain draws
    assert totals["drafted"] > CALLS * SAMPLES  # it speculated at every step
    assert 0.05 < totals["accepted"] / totals["drafted"] < 0.95  # kept some, rejected some
    for p in POSITIONS:
        assert len(set(plain[p])) > 5  # a spread distribution, not one token
        assert homogeneity(plain[p], spec[p]) > 0.01, p


@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_a_seed_gives_the_same_text_on_one_and_three_nodes_speculating(
        ring_model: Path, draft_model: Path, speculate: str) -> None:
    spec = "ngram" if speculate == "ngram" else f"draft:{draft_model}"
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    outs = []
    for nodes in (1, 3):
        with open_engine(EngineSpec(model=ring_model, nodes=nodes, speculate=spec)) as engine:
            outs.append(engine.generate(PROMPT, 24, 3, params))
    one, three = ([s["token_ids"] for s in o.samples] for o in outs)
    assert one == three
    assert all(o.speculation is not None and o.speculation["drafted"] > 0 for o in outs)
