"""Speculation per sample (``mdiedge.runtime.speculation``): adaptive k by table (acceptance
estimate, tokens per cost, off at 0, retried, bounded), and ``Speculation`` drafting within a
sample's budget, settling what the model accepts and counting it."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest
import torch

from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.drafting import NgramDrafter, Proposal
from mdiedge.runtime.speculation import (KPolicy, Speculation, acceptance, choose_k,
                                         expected_tokens)

Rounds = List[Tuple[int, int]]
BAD: Rounds = [(3, 0)] * 8  # every draft rejected
GOOD: Rounds = [(7, 7)] * 8  # every draft kept


@pytest.mark.parametrize("rounds, alpha", [
    ([], 0.5),  # the prior alone
    ([(4, 4)], 5 / 6),  # four kept, no rejection
    ([(4, 1)], 2 / 4),  # one kept, then a rejection
    ([(0, 0), (0, 0)], 0.5),  # the drafter had nothing: no evidence
    ([(2, 0)] * 20, 1 / 10),  # only the last window (8) of drafting rounds counts
])
def test_acceptance_estimate(rounds: Rounds, alpha: float) -> None:
    assert acceptance(rounds, KPolicy()) == pytest.approx(alpha)


@pytest.mark.parametrize("alpha, k, tokens", [(0.0, 5, 1.0), (1.0, 3, 4.0), (0.5, 1, 1.5),
                                              (0.5, 2, 1.75)])
def test_expected_tokens(alpha: float, k: int, tokens: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(tokens)


@pytest.mark.parametrize("rounds, policy, max_k, k", [
    ([], KPolicy(), None, 2),  # acceptance 1/2 assumed: two drafts pay best at row cost 0.1
    ([], KPolicy(row_cost=0.0), None, 7),  # free rows: as many as allowed
    (GOOD, KPolicy(), None, 7),
    (GOOD, KPolicy(), 3, 3),  # the scheduler's bound (rows per frame)
    (GOOD, KPolicy(max_k=5), 6, 5),
    (GOOD, KPolicy(), 0, 0),
    (BAD, KPolicy(), None, 0),  # nothing pays: speculation off for the sample
    (BAD + [(0, 0)] * 15, KPolicy(), None, 0),
    (BAD + [(0, 0)] * 16, KPolicy(), None, 1),  # off long enough: try one draft again
    (BAD + [(0, 0)] * 16, KPolicy(), 0, 0),
    ([(0, 0)] * 40, KPolicy(), None, 2),  # the drafter never had anything: still the prior
    ([(4, 2)] * 8, KPolicy(), None, 4),  # acceptance 17/26: 1.817 tokens per cost
    ([(4, 3)] * 8, KPolicy(row_cost=0.05), None, 6),
])
def test_choose_k(rounds: Rounds, policy: KPolicy, max_k: int, k: int) -> None:
    assert choose_k(rounds, policy, max_k) == k


class Fixed:
    """A drafter proposing ``tokens`` (more than asked, to check the cut) and recording k."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens, self.asked, self.released = list(tokens), [], []  # type: ignore

    def propose(self, sample_id: int, tokens: Sequence[int], k: int) -> Proposal:
        self.asked.append(k)
        return Proposal(self.tokens)

    def release(self, sample_id: int) -> None:
        self.released.append(sample_id)


def one_hot_logits(tokens: Sequence[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_a_step_feeds_the_last_token_and_the_drafts_within_the_budget() -> None:
    drafter = Fixed([4, 5, 6, 7, 8, 9, 1, 2])
    spec = Speculation(drafter, SamplingParams(temperature=0), KPolicy(row_cost=0.0))
    draft = spec.draft(3, [1, 2, 3], budget=4)
    assert drafter.asked == [3]  # at most budget - 1 drafts: a step emits at most 4
    assert (draft.position, draft.tokens, draft.drafted) == (2, [3, 4, 5, 6], 3)
    out = spec.settle(3, draft, one_hot_logits([4, 5, 0, 9]), torch.Generator())
    assert out == [4, 5, 0]
    assert spec.rounds[3] == [(3, 2)]
    assert (spec.stats.drafted, spec.stats.accepted, spec.stats.emitted) == (3, 2, 3)
    assert spec.stats.k_histogram == {3: 1} and spec.stats.tokens_per_step == 3.0
    assert spec.draft(3, [1, 2, 3, 4], budget=1).tokens == [4]  # the last token: plain
    spec.release(3)
    assert drafter.released == [3] and 3 not in spec.rounds


def test_a_sample_whose_drafts_fail_stops_drafting_then_retries() -> None:
    spec = Speculation(NgramDrafter(), SamplingParams(temperature=0))
    text = [1, 2] * 10
    ks = []
    for _ in range(40):
        ks.append(choose_k(spec.rounds.get(0, [])))
        draft = spec.draft(0, text, budget=100)
        model = [(t + 1) % 3 for t in draft.proposal.tokens] + [1]  # disagrees with each draft
        text += spec.settle(0, draft, one_hot_logits(model), torch.Generator())
    first_off = ks.index(0)
    assert ks[0] == 2 and 0 < first_off < 10
    assert ks[first_off:first_off + 16] == [0] * 16 and ks[first_off + 16] == 1
