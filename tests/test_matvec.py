"""The few-row product (``ext/_cmatvec.pyx`` and its twin ``mdiedge/model/_pymatvec.py``):
equal to ``x @ W^T`` within float32 rounding for any shape the decode path sends, a row's
result independent of the rows beside it and of the thread count (compiled), argument checks
quoting the offending value, and ``Linear`` taking it only where it applies."""
from __future__ import annotations

from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdiedge.model.layers import MATVEC
from mdiedge.model.layers import Linear
from tolerance import assert_close

pytestmark = pytest.mark.twins
IMPLS = MATVEC.implementations()
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


def test_both_implementations_present() -> None:
    names = [m.__name__ for m in IMPLS]
    assert "mdiedge.model._pymatvec" in names
    assert len(names) == 2 or "MDIEDGE_NO_EXTENSIONS" in __import__("os").environ


def product(impl: ModuleType, x: torch.Tensor, w: torch.Tensor, threads: int = 1) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    impl.rows(x, w, out, threads)
    return out


@FAST
@given(st.integers(1, 8), st.integers(1, 77), st.integers(1, 300), st.integers(1, 3),
       st.integers(0, 2 ** 31))
def test_equals_the_float64_product(impl: ModuleType, rows: int, n: int, k: int,
                                    threads: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    got = product(impl, x, w, threads)
    exact = (x.double() @ w.double().t())
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) * k ** 0.5 + 1e-6
    assert torch.all((got.double() - exact).abs() <= bound)


@pytest.mark.parametrize("k", [300, 1031])
def test_row_results_do_not_depend_on_batch_or_threads(k: int) -> None:
    """Compiled: a row's outputs are bit-identical alone, in a batch of 8, and on 1 or 3
    threads (n and k chosen to hit the kernel's tails; rows shorter than 1024 are prefetched
    by hand)."""
    if len(IMPLS) < 2:
        pytest.skip("the compiled module is not built")
    compiled = IMPLS[1]
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, k, generator=g), torch.randn(203, k, generator=g)
    batch = product(compiled, x, w, 3)
    for r in range(8):
        assert torch.equal(product(compiled, x[r:r + 1].contiguous(), w, 1), batch[r:r + 1])


@pytest.mark.parametrize("case,match", [
    ("rows", "needs 1..8"), ("dtype", "float32"), ("strided", "contiguous"),
    ("width", "does not take rows of 5"), ("out", r"out \(2, 3\)"), ("threads", "threads 0")])
def test_bad_arguments_say_what(impl: ModuleType, case: str, match: str) -> None:
    x, w, out, threads = torch.randn(2, 4), torch.randn(3, 4), torch.empty(2, 3), 1
    if case == "rows":
        x, out = torch.randn(9, 4), torch.empty(9, 3)
    elif case == "dtype":
        x = x.double()
    elif case == "strided":
        x = torch.randn(4, 2).t()
    elif case == "width":
        x = torch.randn(2, 5)
    elif case == "out":
        out = torch.empty(3, 2).t()
    else:
        threads = 0
    with pytest.raises(ValueError, match=match):
        impl.rows(x, w, out, threads)


@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 1, 16), (2, 5, 16), (8, 16), (1, 40, 16)])
def test_linear_matches_f_linear(shape: tuple) -> None:
    torch.manual_seed(0)
    layer = Linear(16, 24)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (*shape[:-1], 24)
    assert_close(got, torch.nn.functional.linear(x, layer.weight), 16)


def test_linear_keeps_gradients_through_f_linear() -> None:
    layer = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
