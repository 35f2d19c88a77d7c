"""Sampling decisions, table-driven."""
from __future__ import annotations

import math
from typing import Any, List

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


# -- one range per sampling value: the library, the command line and the API agree

SAMPLING_VALUES = [  # (field, value, accepted)
    ("temperature", 0.0, True), ("temperature", 2.0, True), ("temperature", 2.5, False),
    ("temperature", -0.1, False), ("temperature", math.inf, False),
    ("temperature", math.nan, False),
    ("top_p", 1.0, True), ("top_p", 0.01, True), ("top_p", 0.0, False), ("top_p", 1.5, False),
    ("top_k", 0, True), ("top_k", 40, True), ("top_k", -1, False),
    ("seed", 0, True), ("seed", 2 ** 40 - 1, True), ("seed", 2 ** 40, False), ("seed", -1, False),
]


def _library_accepts(name: str, value: object) -> bool:
    from mdiedge.base.errors import GenerationError

    try:
        SamplingParams(**{name: value})
    except GenerationError:
        return False
    return True


def _command_line_accepts(name: str, value: object) -> bool:
    from mdiedge.base.errors import UsageError
    from mdiedge.cli.app import check_sampling

    values = dict(temperature=defaults.TEMPERATURE, top_k=defaults.TOP_K, top_p=defaults.TOP_P,
                  seed=None)
    values[name] = value
    try:
        check_sampling(defaults.MAX_NEW_TOKENS, 1, **values)  # type: ignore[arg-type]
    except UsageError:
        return False
    return True


def _api_accepts(name: str, value: object) -> bool:
    from mdiedge.base.errors import ApiError
    from mdiedge.serving.api.schema import CompletionRequest

    try:
        CompletionRequest.from_json({"prompt": "x", name: value})
    except ApiError as e:
        assert e.status == 400 and e.param == name
        return False
    return True


@pytest.mark.parametrize("name,value,accepted", SAMPLING_VALUES)
def test_one_range_per_sampling_value(name: str, value: object, accepted: bool) -> None:
    assert (_library_accepts(name, value), _command_line_accepts(name, value),
            _api_accepts(name, value)) == (accepted,) * 3


@pytest.mark.parametrize("span,inside,outside,expected", [
    (defaults.TEMPERATURE_RANGE, [0, 0.0, 1, 2.0], [-1e-9, 2.0001, math.nan, True, "1"],
     "a number in [0, 2]"),
    (defaults.TOP_P_RANGE, [1e-9, 1], [0, 0.0, 1.0001], "a number in (0, 1]"),
    (defaults.TOP_K_RANGE, [0, 10 ** 9], [-1, 1.0, math.inf], "an integer >= 0"),
    (defaults.SEED_RANGE, [0, 2 ** 40 - 1], [2 ** 40, -1, 0.0], "an integer in [0, 2**40)"),
    (defaults.MAX_NEW_TOKENS_RANGE, [1], [0, 1.5], "an integer >= 1"),
])
def test_spans(span: Any, inside: list, outside: list, expected: str) -> None:
    assert all(v in span for v in inside) and not any(v in span for v in outside)
    assert span.expected == expected
