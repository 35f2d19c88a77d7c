"""The q8 mode's float16 KV cache: the step's rounding of a float32 to an IEEE half
(``halves``: to nearest even, beyond 65504 infinity, NaN quiet, subnormals kept) against
numpy's, and its widening (``widen_halves``: this CPU's path and the portable C one) exact
for every one of the 65,536 halves, in both twins. A NaN stays a NaN of its sign; its payload
is not kept (F16C quiets a signaling one, numpy does not)."""
from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from mdiedge.model.transformer import STEP

pytestmark = pytest.mark.twins
IMPLS = STEP.implementations()

# zeros, the subnormal halves' step (2^-24) and ties around it, the smallest normal, the
# largest finite half and the tie beyond it, infinities, NaN, ties to even above 1, others
EDGES = np.array([0.0, -0.0, 2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -24, 3 * 2.0 ** -25,
                  6.1035156e-05, 65504.0, 65519.996, 65520.0, 1e6, -1e6, np.inf, -np.inf,
                  np.nan, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0009765625, -3.14159,
                  1e-30, -2.0 ** -15], np.float32)


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


def numpy_halves(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(np.float16).view(np.uint16)


def same_or_both_nan(got: np.ndarray, want: np.ndarray, dtype: type) -> None:
    nan = np.isnan(want.view(dtype))
    assert np.isnan(got.view(dtype)[nan]).all()
    assert (np.signbit(got.view(dtype)[nan]) == np.signbit(want.view(dtype)[nan])).all()
    assert got[~nan].tolist() == want[~nan].tolist()


def test_halves_round_as_numpy_does(impl: ModuleType) -> None:
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(4096) * 10.0 ** rng.integers(-9, 6, 4096)).astype(np.float32)
    bits = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for values in (EDGES, spread, bits):
        got = impl.halves(values, np.empty(values.shape[0], np.uint16))
        same_or_both_nan(got, numpy_halves(values), np.float16)


@pytest.mark.parametrize("reference", [False, True])
def test_every_half_widens_exactly(impl: ModuleType, reference: bool) -> None:
    every = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    got = impl.widen_halves(every, np.empty(every.shape[0], np.float32), reference)
    want = every.view(np.float16).astype(np.float32)
    same_or_both_nan(got.view(np.uint32), want.view(np.uint32), np.float32)


@pytest.mark.parametrize("values, out, message", [
    (np.zeros(4, np.float64), np.zeros(4, np.uint16), r"values \(4,\) float64 is not"),
    (np.zeros(4, np.float32), np.zeros(3, np.uint16), "4 values into out of 3"),
    (np.zeros((2, 2), np.float32), np.zeros(4, np.uint16), r"values \(2, 2\) float32"),
    (np.zeros(4, np.float32), np.zeros(4, np.int16), r"out \(4,\) int16 is not"),
])
def test_bad_arguments_quote_the_value(impl: ModuleType, values: np.ndarray, out: np.ndarray,
                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        impl.halves(values, out)
