"""Speculation per sample (``mdiedge.runtime.speculation``): adaptive k by table (acceptance
estimate, tokens per cost, off at 0, retried, bounded), and ``Speculation`` drafting within a
sample's budget, settling what the model accepts and counting it."""
from __future__ import annotations

from types import SimpleNamespace
from typing import List, Sequence, Tuple

import pytest
import torch

from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.drafting import NgramDrafter, Proposal
from mdiedge.runtime.speculation import (KPolicy, RowCost, Speculation, acceptance,
                                         choose_k, expected_tokens, group_width, plan_step)

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


# ------------------------------------------------------------------ a group's width


@pytest.mark.parametrize("wants, rows, room, width", [
    ([(0.9, 7)], 8, 100, 8),  # one sample that keeps its drafts: every row it may have
    ([(0.9, 2)], 8, 100, 3),  # one sample: the k it wants
    ([(0.9, 7)], 8, 3, 3),  # the context's room bounds a row
    ([(0.9, 7), (0.1, 0)], 8, 100, 4),  # the good sample pays for the other's padding
    ([(0.2, 0)] * 3, 8, 100, 1),  # nobody keeps drafts: a plain step
    ([(0.2, 1), (0.2, 0), (0.2, 0)], 8, 100, 2),  # a retry is honoured
    ([(0.95, 7)] * 4, 8, 100, 2),  # four samples share eight rows
    ([(0.9, 7)] * 9, 8, 100, 1),  # more samples than rows: plain
    ([(0.95, 7)] * 4, 32, 100, 8),  # a step call's 32 rows: four samples' whole drafts
    ([(0.95, 7)] * 8, 32, 100, 4),
    ([(0.9, 7)], 32, 100, 8),  # a sample verifies at most SPECULATION_MAX_K + 1 rows
    ([(0.9, 7)] * 33, 32, 100, 1),
    ([], 8, 100, 1),
])
def test_group_width(wants: List[Tuple[float, int]], rows: int, room: int,
                     width: int) -> None:
    assert group_width(wants, rows, room, 0.1) == width


@pytest.mark.parametrize("rounds", [[], GOOD, BAD, BAD + [(0, 0)] * 16, [(4, 1)] * 3,
                                    [(3, 3), (3, 1)] * 4])
def test_one_samples_width_is_its_own_k(rounds: Rounds) -> None:
    """Alone in its group, a sample's step is as wide as its adaptive k says."""
    policy = KPolicy()
    k = choose_k(rounds, policy)
    assert group_width([(acceptance(rounds, policy), k)], 8, 1000, policy.row_cost) == k + 1


class _Group:
    """A group of two live samples of one request, as ``plan_step`` reads it."""

    def __init__(self, texts: Sequence[List[int]], speculation: Speculation) -> None:
        self.generation = SimpleNamespace(speculation=speculation, max_new_tokens=100)
        self.samples = [SimpleNamespace(sid=10 + i, index=i, done=False, prompt=text[:-1],
                                        tokens=text[-1:]) for i, text in enumerate(texts)]


def test_a_sample_without_drafts_does_not_hold_back_one_that_has_them() -> None:
    """One sample repeats its text (the drafter proposes), the other has nothing to look
    up: the step still verifies the first's drafts, the second's row is padded."""
    spec = Speculation(NgramDrafter(), SamplingParams(temperature=0))
    for sample in (0, 1):  # both have kept their drafts so far
        spec.rounds[sample] = list(GOOD)
    repeating, fresh = [1, 2, 3, 4, 5, 6] * 4, list(range(20, 44))
    width = plan_step(_Group([repeating, fresh], spec), context=512)
    assert width == 7  # two samples x 7 positions, the best expected tokens per cost
    first, second = spec.pending[10], spec.pending[11]
    assert first.drafted == 6 and first.tokens == [6, 1, 2, 3, 4, 5, 6]
    assert second.drafted == 0 and second.tokens == [43] * 7
    out = spec.settle(1, second, one_hot_logits([7] * 7), torch.Generator())
    assert out == [7]  # its one position scored: the padding is not


# ------------------------------------------------------------------ a row's measured cost


def timed(points: Sequence[Tuple[int, Sequence[float]]]) -> RowCost:
    cost = RowCost(prior=0.1)
    for rows, times in points:
        for seconds in times:
            cost.observe(rows, seconds)
    return cost


@pytest.mark.parametrize("points, value", [
    ([], 0.1),  # nothing timed: the prior
    ([(1, [0.010] * 3)], 0.1),  # one row count: no slope yet
    ([(1, [0.010] * 3), (8, [0.017] * 2)], 0.1),  # too few timings of 8 rows
    ([(1, [0.010] * 3), (8, [0.017] * 3)], 0.1),  # 1 ms a row on a 10 ms step
    ([(1, [0.010] * 3), (4, [0.025] * 3), (8, [0.045] * 3)], 0.5),  # a step per two rows
    ([(1, [0.030, 0.010, 0.020]), (8, [0.017, 0.090, 0.050])], 0.1),  # the fastest counts
    ([(2, [0.010] * 3), (8, [0.010] * 3)], 0.0),  # rows for free
    ([(1, [0.010] * 3), (2, [0.040] * 3)], 2.0),  # bounded
    ([(1, [0.050] * 3), (8, [0.010] * 3)], 0.0),  # faster with more rows: noise, free
])
def test_row_cost_is_fitted_from_the_fastest_timings(
        points: Sequence[Tuple[int, Sequence[float]]], value: float) -> None:
    assert timed(points).value == pytest.approx(value)


def test_only_the_latest_timings_count() -> None:
    cost = timed([(1, [0.010] * 3), (8, [0.010] * 3)])
    assert cost.value == 0.0
    for _ in range(cost.window):  # the machine's rows got dearer
        cost.observe(8, 0.017)
    assert cost.value == pytest.approx(0.1)


@pytest.mark.parametrize("temperature, width", [(0.0, 1), (0.8, 7)])
def test_the_measured_cost_decides_greedy_widths_only(temperature: float, width: int) -> None:
    """Rows measured dear: a greedy group steps plainly; a sampled one keeps its policy's
    cost (its k must not depend on the pipeline, for its seed's sake)."""
    spec = Speculation(NgramDrafter(), SamplingParams(temperature=temperature, seed=1))
    for sample in (0, 1):
        spec.rounds[sample] = list(GOOD)
    repeating = [1, 2, 3, 4, 5, 6] * 4
    assert plan_step(_Group([repeating, repeating], spec), 512, row_cost=1.5) == width
