"""Sampling decisions, table-driven."""
from __future__ import annotations

import math
from typing import List

import pytest
import torch

from mdiedge.base import defaults
from mdiedge.model.sampling import SamplingParams, filter_logits, sample_generator, sample_rows

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


@pytest.mark.parametrize("params,kept", [
    (SamplingParams(temperature=1.0, top_p=1.0), [0, 1, 2, 3, 4]),
    (SamplingParams(temperature=1.0, top_p=0.95), [0, 1, 2, 3]),
    (SamplingParams(temperature=1.0, top_k=2, top_p=1.0), [0, 1]),
    (SamplingParams(temperature=1.0, top_k=1, top_p=1.0), [0]),
    (SamplingParams(temperature=1.0, top_p=0.5), [0]),
    (SamplingParams(temperature=1.0, top_p=0.6), [0, 1]),
    (SamplingParams(temperature=1.0, top_p=0.9), [0, 1, 2]),
    (SamplingParams(temperature=1.0, top_k=4, top_p=0.99), [0, 1, 2, 3]),
    (SamplingParams(temperature=0.5, top_p=0.01), [0]),
])
def test_filters_keep_the_expected_tokens(params: SamplingParams, kept: List[int]) -> None:
    out = filter_logits(LOGITS, params)
    assert torch.isfinite(out).nonzero().flatten().tolist() == kept


def test_temperature_scales_logits() -> None:
    out = filter_logits(LOGITS, SamplingParams(temperature=2.0, top_p=1.0))
    assert torch.allclose(out, LOGITS / 2)


def test_default_params_are_the_cli_defaults() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.seed) == \
        (defaults.TEMPERATURE, defaults.TOP_K, defaults.TOP_P, defaults.SEED)
    assert (params.temperature, params.top_p) == (0.8, 0.95) and not params.greedy


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert sample_rows(logits, SamplingParams(temperature=0), []) == [1, 0]


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (1e-300, True), (1e-45, True), (9.9e-6, True), (1e-5, False), (0.8, False)])
def test_a_temperature_near_zero_is_greedy(temperature: float, greedy: bool) -> None:
    params = SamplingParams(temperature=temperature, top_p=1.0)
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 4.99]]) * 30
    assert params.greedy is greedy
    rows = sample_rows(logits, params, [sample_generator(0, 0), sample_generator(0, 1)])
    assert rows == [1, 0]  # greedy, or a distribution all but certain of the argmax


def test_each_sample_has_its_own_stream() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits = torch.zeros(2, 1000)
    a = sample_rows(logits, params, [sample_generator(3, 0), sample_generator(3, 1)])
    b0 = sample_rows(logits[:1], params, [sample_generator(3, 0)])
    b1 = sample_rows(logits[1:], params, [sample_generator(3, 1)])
    assert a == b0 + b1 and a[0] != a[1]


def test_sampling_follows_the_distribution() -> None:
    params = SamplingParams(temperature=1.0, top_p=1.0)
    gen = sample_generator(0, 0)
    draws = [sample_rows(LOGITS[None], params, [gen])[0] for _ in range(4000)]
    assert math.isclose(draws.count(0) / 4000, 0.5, abs_tol=0.03)
