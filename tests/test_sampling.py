"""Sampling decisions, table-driven."""
from __future__ import annotations

import math
from typing import Any, List

import numpy as np
import pytest

from mdiedge.base import defaults
from mdiedge.model.sampling import SamplingParams, filter_logits, sample_generator, sample_rows

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))


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
    assert np.flatnonzero(np.isfinite(out)).tolist() == kept


def test_temperature_scales_logits() -> None:
    out = filter_logits(LOGITS, SamplingParams(temperature=2.0, top_p=1.0))
    assert np.allclose(out, LOGITS / 2)


def test_default_params_are_the_cli_defaults() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.seed) == \
        (defaults.TEMPERATURE, defaults.TOP_K, defaults.TOP_P, defaults.SEED)
    assert (params.temperature, params.top_p) == (0.8, 0.95) and not params.greedy


def test_greedy_is_argmax() -> None:
    logits = np.array([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]], dtype=np.float32)
    assert sample_rows(logits, SamplingParams(temperature=0), []) == [1, 0]


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (1e-300, True), (1e-45, True), (9.9e-6, True), (1e-5, False), (0.8, False)])
def test_a_temperature_near_zero_is_greedy(temperature: float, greedy: bool) -> None:
    params = SamplingParams(temperature=temperature, top_p=1.0)
    logits = np.array([[0.1, 3.0, 2.9], [5.0, 0.0, 4.99]], dtype=np.float32) * 30
    assert params.greedy is greedy
    rows = sample_rows(logits, params, [sample_generator(0, 0), sample_generator(0, 1)])
    assert rows == [1, 0]  # greedy, or a distribution all but certain of the argmax


def test_each_sample_has_its_own_stream() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits = np.zeros((2, 1000), dtype=np.float32)
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
    from mdiedge.cli.app import asked

    values = dict(temperature=defaults.TEMPERATURE, top_k=defaults.TOP_K, top_p=defaults.TOP_P,
                  seed=None)
    values[name] = value
    try:
        asked(defaults.MAX_NEW_TOKENS, 1, **values)  # type: ignore[arg-type]
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


# -- penalties, biases and min-p: OpenAI's and llama.cpp's definitions, term by term

ROW = np.array([2.0, -1.0, 0.5, 0.0, 1.0], dtype=np.float32)


@pytest.mark.parametrize("params, prompt, output, expected", [
    # frequency: logit - count * f, over the output only (the prompt's tokens not counted)
    (dict(frequency_penalty=0.5), [0], [2, 2, 4], [2.0, -1.0, -0.5, 0.0, 0.5]),
    # presence: logit - p once a token appeared in the output, whatever its count
    (dict(presence_penalty=1.0), [0], [2, 2, 4], [2.0, -1.0, -0.5, 0.0, 0.0]),
    # both, and a negative penalty encourages repeats
    (dict(presence_penalty=-1.0, frequency_penalty=0.25), [], [1, 1], [2.0, -0.5, 0.5, 0.0, 1.0]),
    # repetition: over prompt and output, positive logits divided, negative multiplied
    (dict(repetition_penalty=2.0), [0, 1], [4], [1.0, -2.0, 0.5, 0.0, 0.5]),
    (dict(repetition_penalty=0.5), [0, 1], [], [4.0, -0.5, 0.5, 0.0, 1.0]),
    # logit_bias: added, before the penalties (which then see the biased logit)
    (dict(logit_bias={3: -100}), [], [], [2.0, -1.0, 0.5, -100.0, 1.0]),
    (dict(logit_bias={1: 4.0}, repetition_penalty=2.0), [1], [], [2.0, 1.5, 0.5, 0.0, 1.0]),
    (dict(logit_bias={9: 5.0}), [], [], [2.0, -1.0, 0.5, 0.0, 1.0]),  # past the vocabulary
    (dict(), [0], [0, 0], [2.0, -1.0, 0.5, 0.0, 1.0]),  # neutral values change nothing
])
def test_penalties_change_the_logits_as_documented(params: Any, prompt: List[int],
                                                   output: List[int], expected: List[float]
                                                   ) -> None:
    from mdiedge.model.sampling import penalize

    out = penalize(ROW, SamplingParams(temperature=0, **params), prompt, output)
    assert out.tolist() == pytest.approx(expected)
    assert ROW.tolist() == [2.0, -1.0, 0.5, 0.0, 1.0]  # the model's row is not changed


@pytest.mark.parametrize("params, history, token", [
    (dict(), ([], []), 0),  # greedy: the argmax
    (dict(logit_bias={0: -100}), ([], []), 4),  # the greedy token banned: the next one
    (dict(logit_bias={3: 100}), ([], []), 3),  # +100 forces a token
    (dict(frequency_penalty=2.0), ([], [0]), 4),  # applied before the argmax
    (dict(presence_penalty=1.5), ([], [0]), 4),
    (dict(presence_penalty=1.5), ([0], []), 0),  # presence counts the output only
    (dict(repetition_penalty=2.5), ([0], []), 4),  # repetition counts the prompt too
])
def test_greedy_takes_the_argmax_after_penalties(params: Any, history: Any, token: int) -> None:
    for temperature in (0.0, 1.0):  # and sampling draws from the changed row
        sampling = SamplingParams(temperature=temperature, top_k=1 if temperature else 0,
                                  **params)
        assert sample_rows(ROW[None], sampling, [sample_generator(0, 0)],
                           [history]) == [token]


def test_a_bias_shifts_the_sampled_distribution() -> None:
    params = SamplingParams(temperature=1.0, top_p=1.0, logit_bias={4: math.log(0.5 / 0.03)})
    gen = sample_generator(0, 0)
    draws = [sample_rows(LOGITS[None], params, [gen], [([], [])])[0] for _ in range(4000)]
    # token 4 (p 0.03) now as likely as token 0: each about 0.5 / 1.47
    assert math.isclose(draws.count(4) / 4000, 0.5 / 1.47, abs_tol=0.03)
    assert math.isclose(draws.count(0) / 4000, 0.5 / 1.47, abs_tol=0.03)


@pytest.mark.parametrize("min_p, kept", [
    (0.0, [0, 1, 2, 3, 4]), (0.1, [0, 1, 2, 3]), (0.29, [0, 1, 2]), (0.31, [0, 1]), (0.5, [0, 1]),
    (1.0, [0])])  # 0.3 is token 2's share exactly: float rounding decides
def test_min_p_keeps_tokens_at_least_that_share_of_the_likeliest(min_p: float,
                                                                 kept: List[int]) -> None:
    out = filter_logits(LOGITS, SamplingParams(temperature=1.0, top_p=1.0, min_p=min_p))
    assert np.flatnonzero(np.isfinite(out)).tolist() == kept


def test_logprobs_are_the_models_log_softmax_with_the_likeliest() -> None:
    from mdiedge.model.sampling import token_logprobs

    rows = np.stack([LOGITS, LOGITS[::-1]]) + 3.0  # logits, not log-probabilities
    scored = token_logprobs(rows, [2, 0], 2)
    assert scored[0].logprob == pytest.approx(math.log(0.15), abs=1e-6)
    assert [t for t, _ in scored[0].top] == [0, 1] and [t for t, _ in scored[1].top] == [4, 3]
    assert scored[1].top[0][1] == pytest.approx(math.log(0.5), abs=1e-6)
    assert token_logprobs(rows[:1], [1], 0)[0].top == ()


PENALTY_VALUES = [  # (field, value, accepted): the library's and the API's one range
    ("presence_penalty", 2.0, True), ("presence_penalty", -2.0, True),
    ("presence_penalty", 2.1, False), ("frequency_penalty", -2.5, False),
    ("repetition_penalty", 1.3, True), ("repetition_penalty", 0, False),
    ("repetition_penalty", 11, False), ("min_p", 0.05, True), ("min_p", -0.1, False),
    ("min_p", 1.01, False),
]


@pytest.mark.parametrize("name,value,accepted", PENALTY_VALUES)
def test_one_range_per_penalty(name: str, value: object, accepted: bool) -> None:
    assert (_library_accepts(name, value), _api_accepts(name, value)) == (accepted,) * 2


@pytest.mark.parametrize("bias, message", [
    ({-1: 1.0}, "token ids >= 0, got -1"), ({"3": 1.0}, "got '3'"),
    ({3: 100.5}, "logit_bias[3]: expected a number in [-100, 100], got 100.5"),
    ({i: 1.0 for i in range(defaults.MAX_LOGIT_BIAS + 1)}, "at most 1024 tokens"),
])
def test_a_bad_logit_bias_is_one_line_naming_it(bias: Any, message: str) -> None:
    from mdiedge.base.errors import GenerationError

    with pytest.raises(GenerationError) as caught:
        SamplingParams(logit_bias=bias)
    assert message in str(caught.value)


@pytest.mark.parametrize("scale, top_p", [(6.0, 0.95), (3.0, 0.9), (0.5, 0.5), (8.0, 0.999)])
def test_top_p_keeps_what_sorting_the_whole_row_keeps(scale: float, top_p: float) -> None:
    """The nucleus sorts only the tokens that can be in it: the same set as a full sort."""
    rng = np.random.Generator(np.random.PCG64(int(scale * 10)))
    logits = (rng.standard_normal(5000) * scale).astype(np.float32)
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order].astype(np.float64) - logits.max())
    probs /= probs.sum()
    want = sorted(order[np.cumsum(probs) - probs < top_p].tolist())
    out = filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert np.flatnonzero(np.isfinite(out)).tolist() == want


def test_a_draw_never_takes_a_token_of_weight_zero() -> None:
    from mdiedge.model.sampling import draw

    weights = np.zeros(1000, dtype=np.float32)
    weights[[0, 500, 999]] = [0.2, 0.5, 0.3]
    gen = sample_generator(1, 0)
    draws = [draw(weights, gen) for _ in range(3000)]
    assert set(draws) == {0, 500, 999}
    assert math.isclose(draws.count(500) / 3000, 0.5, abs_tol=0.04)
