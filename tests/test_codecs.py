"""Activation codecs (fp16, blockwise int8) against the compiled module and its pure-Python
twin: round-trip error within each codec's bound for any size, inf/NaN coded explicitly,
saturation, empty and odd sizes, size checks, and byte-identical twins."""
from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdiedge.base import codecs
from mdiedge.runtime.framing import CODEC
from mdiedge.base.codecs import FP16, INT8, Compression, encoded_size, int8_error_bound
from mdiedge.base.errors import ConfigError, FrameError

pytestmark = pytest.mark.twins
IMPLS = CODEC.implementations()
FAST = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
FINITE = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False)
ANY = st.floats(width=32)  # NaN, inf, subnormals, beyond fp16's range


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


def round_trip(impl: ModuleType, codec: int, x: np.ndarray) -> np.ndarray:
    raw = np.full(encoded_size(codec, x.size), 0xAB, dtype=np.uint8)  # garbage: all overwritten
    impl.encode(codec, x, raw)
    y = np.full(x.size, 12345.0, dtype=np.float32)
    impl.decode(codec, raw, y)
    return y


def test_both_implementations_present() -> None:
    names = [m.__name__ for m in IMPLS]
    assert "mdiedge.runtime._pycodec" in names
    assert len(names) == 2 or "MDIEDGE_NO_EXTENSIONS" in __import__("os").environ


@FAST
@given(st.lists(FINITE, max_size=300))
def test_fp16_error_within_half_an_ulp(impl: ModuleType, values: list) -> None:
    x = np.array(values, dtype=np.float32)
    y = round_trip(impl, FP16, x)
    clipped = np.clip(x, -codecs.FP16_MAX, codecs.FP16_MAX)
    bound = np.maximum(np.abs(clipped) * 2.0 ** -11, 2.0 ** -25)  # subnormals: absolute
    assert np.all(np.abs(y - clipped) <= bound)


@FAST
@given(st.lists(FINITE, max_size=300), st.integers(0, 2))
def test_int8_error_within_the_block_bound(impl: ModuleType, values: list, scale: int) -> None:
    x = np.array(values, dtype=np.float32) * np.float32(10.0 ** (-3 * scale))
    y = round_trip(impl, INT8, x)
    for start in range(0, x.size, codecs.BLOCK):
        block, back = x[start:start + 32], y[start:start + 32]
        bound = int8_error_bound(float(np.abs(block).max()))
        assert np.all(np.abs(back.astype(np.float64) - block) <= bound), (start, block, back)


@FAST
@given(st.lists(ANY, max_size=200))
def test_twins_encode_identical_bytes_and_nonfinite_round_trips(values: list) -> None:
    x = np.array(values, dtype=np.float32)
    for codec in (FP16, INT8):
        outs = []
        for impl in IMPLS:
            raw = np.zeros(encoded_size(codec, x.size), dtype=np.uint8)
            impl.encode(codec, x, raw)
            outs.append(raw)
            y = round_trip(impl, codec, x)
            assert np.array_equal(np.isnan(y), np.isnan(x))  # NaN stays NaN, only NaN
            inf = np.isinf(x)
            assert np.array_equal(y[inf], x[inf]) and not np.isinf(y[~inf]).any()
        assert all(np.array_equal(o, outs[0]) for o in outs)


def test_nonfinite_values_do_not_spoil_their_block(impl: ModuleType) -> None:
    x = np.linspace(-1, 1, 40, dtype=np.float32)
    x[[3, 7, 35]] = [np.inf, np.nan, -np.inf]
    y = round_trip(impl, INT8, x)
    assert (y[3], y[35]) == (np.inf, -np.inf) and np.isnan(y[7])
    ok = np.isfinite(x)
    assert np.all(np.abs(y[ok] - x[ok]) <= int8_error_bound(1.0))


def test_out_of_range_values_saturate(impl: ModuleType) -> None:
    x = np.array([1e5, -1e5, 3e38, -3e38, 1.0], dtype=np.float32)
    assert round_trip(impl, FP16, x).tolist() == [65504.0, -65504.0, 65504.0, -65504.0, 1.0]
    y = round_trip(impl, INT8, x)
    assert y[2] == codecs.INT8_LIMIT and y[3] == -codecs.INT8_LIMIT


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 65, 1000])
def test_odd_and_empty_sizes(impl: ModuleType, n: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    assert encoded_size(INT8, n) == n + 2 * -(-n // 32)
    y = round_trip(impl, INT8, x)
    assert y.shape == x.shape and (n == 0 or np.abs(y - x).max() < 0.05)
    assert np.array_equal(round_trip(impl, FP16, x), x.astype(np.float16).astype(np.float32))


def test_all_zero_and_tiny_blocks(impl: ModuleType) -> None:
    x = np.array([0.0] * 32 + [1e-30, -1e-30] + [0.0] * 30, dtype=np.float32)
    y = round_trip(impl, INT8, x)
    assert np.abs(y).max() <= 1e-30 and not np.isnan(y).any()


def test_sizes_checked_before_writing(impl: ModuleType) -> None:
    x = np.ones(33, dtype=np.float32)
    with pytest.raises(FrameError, match="33 values take 37 bytes, got 36"):
        impl.encode(INT8, x, np.zeros(36, dtype=np.uint8))
    with pytest.raises(FrameError, match="33 values take 66 bytes, got 64"):
        impl.decode(FP16, np.zeros(64, dtype=np.uint8), x)
    with pytest.raises(FrameError, match="codec code 0"):
        impl.encode(0, x, np.zeros(132, dtype=np.uint8))
    with pytest.raises(FrameError, match="read-only"):
        impl.decode(FP16, np.zeros(66, dtype=np.uint8), bytes(132))


def test_int8_is_at_least_3_5_times_smaller() -> None:
    assert 4 * 2048 / encoded_size(INT8, 2048) > 3.7


def test_compression_spellings() -> None:
    assert Compression.parse("int8") == Compression("int8", "int8")
    c = Compression.parse("int8:fp16")
    assert (c.code(True), c.code(False), str(c)) == (INT8, FP16, "int8:fp16")
    assert Compression.from_wire(c.wire) == c
    for bad in ("int4", "int8:", "a:b:c", ""):
        with pytest.raises(ConfigError, match=repr(bad)):
            Compression.parse(bad)
    with pytest.raises(ConfigError, match="0309"):
        Compression.from_wire(b"\x03\x09")
