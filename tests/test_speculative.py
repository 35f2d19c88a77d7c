"""Verification of drafted tokens (``mdiedge.model.speculative``): greedy acceptance by
table, and the speculative sampling rule keeping the model's distribution: a chi-square test
of one verification against p for a drafter with distributions and for one-hot drafts, and
of the second and fifth generated tokens of a tiny model decoded with a draft model against
plain sampling (p > 0.01), on seeded draws that repeat exactly."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import pytest
import torch

from mdiedge.model.config import ModelConfig
from mdiedge.model.sampling import SamplingParams, sample_generator
from mdiedge.model.speculative import (accept, distributions, greedy_accept, sampled_accept)
from mdiedge.model.transformer import Transformer
from mdiedge.runtime.draftmodel import DraftModel
from mdiedge.runtime.pipeline import EmbedAndHead, Pipeline
from mdiedge.runtime.speculation import KPolicy, Speculation
from mdiedge.runtime.stages import LocalStage
from specloop import decode


@pytest.mark.parametrize("drafts, argmaxes, out", [
    ([], [7], [7]),  # nothing drafted: the model's token
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all kept, and the one after
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the first mismatch: the model's token there
    ([5, 6, 7], [1, 6, 7, 8], [1]),  # the first draft wrong: one token, as a plain step
    ([4, 4], [4, 4, 4], [4, 4, 4]),
])
def test_greedy_accepts_the_longest_matching_prefix_and_one(drafts: List[int],
                                                            argmaxes: List[int],
                                                            out: List[int]) -> None:
    assert greedy_accept(drafts, argmaxes) == out


def test_greedy_refuses_a_wrong_number_of_model_tokens() -> None:
    with pytest.raises(ValueError, match="2 model tokens for 2 drafts"):
        greedy_accept([1, 2], [1, 2])


def test_accept_is_greedy_on_raw_argmax_for_greedy_params() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    gen = sample_generator(0, 0)  # a torch tensor of logits is taken as numpy
    assert accept([1, 0], logits, None, SamplingParams(temperature=0), gen) == [1, 0, 2]
    assert accept([1, 2], logits, None, SamplingParams(temperature=0), gen) == [1, 0]


def p_value(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution: Q(df / 2, stat / 2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def goodness_of_fit(counts: torch.Tensor, probs: np.ndarray) -> float:
    """p-value of ``counts`` drawn from ``probs`` (cells expected under 5 pooled)."""
    probs = torch.as_tensor(np.asarray(probs, dtype=np.float32))
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big].float(), counts[~big].sum().float().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return p_value(stat, int(keep.sum()) - 1)


def homogeneity(a: Sequence[int], b: Sequence[int], vocab: int) -> float:
    """p-value that two samples of tokens come from one distribution (2 x vocab table)."""
    table = torch.stack([torch.bincount(torch.tensor(x), minlength=vocab).float()
                         for x in (a, b)])
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    return p_value(stat, table.shape[1] - 1)


def test_the_p_value_matches_known_chi_square_quantiles() -> None:
    assert p_value(6.635, 1) == pytest.approx(0.01, abs=1e-4)
    assert p_value(18.307, 10) == pytest.approx(0.05, abs=1e-4)


P = np.array([0.30, 0.05, 0.25, 0.0, 0.15, 0.25], dtype=np.float32)
P_NEXT = np.array([0.1, 0.2, 0.3, 0.2, 0.1, 0.1], dtype=np.float32)
Q = np.array([0.05, 0.40, 0.10, 0.20, 0.15, 0.10], dtype=np.float32)  # where p is small or 0


def rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


@pytest.mark.parametrize("one_hot", [False, True])
def test_one_verification_emits_tokens_distributed_as_p(one_hot: bool) -> None:
    draws = 4000
    draft_gen, gen = rng(1), rng(2)
    first, kept = torch.zeros(6, dtype=torch.long), 0
    for _ in range(draws):
        x = 1 if one_hot else int(draft_gen.choice(6, p=Q / Q.sum()))
        out = sampled_accept([x], np.stack([P, P_NEXT]), None if one_hot else Q[None], gen)
        first[out[0]] += 1
        kept += len(out) == 2
    assert goodness_of_fit(first, P) > 0.01
    expected_kept = float(P[1]) if one_hot else float(np.minimum(P, Q).sum())
    assert kept / draws == pytest.approx(expected_kept, abs=0.025)


def test_sampled_acceptance_repeats_for_a_seed() -> None:
    p = np.stack([P, P_NEXT, P])
    runs = [[sampled_accept([2, 0], p, np.repeat(Q[None], 2, 0), rng(s))
             for s in range(30)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 3


def test_sampled_refuses_mismatched_distributions() -> None:
    with pytest.raises(ValueError, match=r"model distributions \(1, 6\) for 1 drafts"):
        sampled_accept([1], P[None], None, rng(0))
    with pytest.raises(ValueError, match=r"draft distributions \(1, 5\) for 1 drafts"):
        sampled_accept([1], np.stack([P, P]), np.ones((1, 5)) / 5, rng(0))


def test_distributions_follow_the_sampling_transforms() -> None:
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], dtype=np.float32)
    top2 = distributions(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0))[0]
    assert top2[2:].sum() == 0 and top2.sum() == pytest.approx(1.0)
    hot = distributions(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0))[0]
    assert np.allclose(hot, torch.softmax(torch.from_numpy(logits[0]) / 0.5, -1).numpy())


VOCAB = 8
TINY = ModelConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                   intermediate_size=24, max_seq_len=32)


def tiny(seed: int, std: float) -> Transformer:
    torch.manual_seed(seed)
    net = Transformer(TINY).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, std) if p.dim() == 2 else p.fill_(1.0)
    net.fuse_projections()
    return net


def test_speculative_sampling_keeps_the_models_distribution(one_thread: None) -> None:
    """Second and fifth tokens with a draft model (another random model: its proposals are
    often rejected), top-p and temperature applied, against the exact distribution of the
    second and plain decoding's fifth."""
    params = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, seed=0)
    target = tiny(0, 0.6)
    pipeline = Pipeline([LocalStage(target, 1, TINY.max_seq_len, trim_prefill=True)])
    ends = EmbedAndHead(target)
    drafter = DraftModel(tiny(1, 0.6), 1, TINY.max_seq_len).drafter(params)
    speculation = Speculation(drafter, params, KPolicy(max_k=3, row_cost=0.0))
    prompt, runs = [1, 5, 3], 600
    plain = [decode(pipeline, ends, prompt, 5, params, None, 0,
                    sample_generator(0, i)).tokens for i in range(runs)]
    spec = [decode(pipeline, ends, prompt, 5, params, speculation, i,  # the draft's draws
                   sample_generator(1, i)).tokens for i in range(runs)]  # are per sample id
    assert speculation.stats.drafted > runs and 0 < speculation.stats.acceptance < 0.9
    assert drafter.samples == 0  # every run released its sample
    second = torch.bincount(torch.tensor([t[1] for t in spec]), minlength=VOCAB)
    assert goodness_of_fit(second, exact_second(target, prompt, params)) > 0.01
    assert homogeneity([t[4] for t in plain], [t[4] for t in spec], VOCAB) > 0.01


def exact_second(net: Transformer, prompt: List[int], params: SamplingParams) -> np.ndarray:
    """The model's distribution of its second generated token after ``prompt``."""
    net.setup_cache(1, TINY.max_seq_len)
    slot = torch.tensor([0])
    with torch.inference_mode():
        first = distributions(net(torch.tensor([prompt]), slot, [0]), params)[0]
        total = np.zeros(VOCAB)
        for t in range(VOCAB):
            if first[t] > 0:
                row = net(torch.tensor([prompt + [t]]), slot, [0])
                total += first[t] * distributions(row, params)[0]
    net.setup_cache(1, TINY.max_seq_len)
    return total


@pytest.mark.parametrize("params, history, want", [
    # the model's argmax is token 1 at both positions: the draft 1 is kept, then ...
    (SamplingParams(temperature=0), ([], []), [1, 1]),
    # ... a frequency penalty counts the kept draft as output: the second argmax is 2
    (SamplingParams(temperature=0, frequency_penalty=1.5), ([], []), [1, 2]),
    # and counts the output before the step too: the draft is rejected at once
    (SamplingParams(temperature=0, frequency_penalty=1.5), ([0], [1]), [2]),
    # a repetition penalty counts the prompt
    (SamplingParams(temperature=0, repetition_penalty=3.0), ([1], []), [2]),
    (SamplingParams(temperature=0, logit_bias={1: -100}), ([], []), [2]),
])
def test_verification_applies_penalties_before_the_argmax(params: SamplingParams, history: tuple,
                                                          want: List[int]) -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0], [0.0, 3.0, 2.0]])
    for sampled in (False, True):  # top-k 1: sampling from one token, the argmax
        if sampled:
            params = SamplingParams(**dict(params.__dict__, temperature=1.0, top_k=1))
        assert accept([1], logits, None, params, sample_generator(0, 0), history) == want
