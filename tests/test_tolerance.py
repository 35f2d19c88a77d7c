"""The tolerance of the float comparisons (tests/tolerance.py): two orders of the same sums
stay within it where a per-value relative tolerance fails them, and one wrong term does not."""
from __future__ import annotations

import pytest
import torch

from tolerance import assert_close


def orders() -> "tuple[torch.Tensor, torch.Tensor]":
    """Rows of 512 products of random sign summed by torch (blocked, vectorised) and one
    term after another (cumsum): the same sums in two orders."""
    g = torch.Generator().manual_seed(0)
    terms = torch.randn(4000, 512, generator=g) * torch.randn(512, generator=g)
    return terms.sum(-1), terms.cumsum(-1)[:, -1].contiguous()


def test_two_orders_of_the_same_sums_are_close() -> None:
    blocked, sequential = orders()
    assert not torch.allclose(blocked, sequential, rtol=1e-5, atol=1e-6)  # sums near zero
    assert_close(blocked, sequential, 512)


def test_one_wrong_term_is_not() -> None:
    blocked, sequential = orders()
    sequential[7] += 0.01 * sequential.abs().max()
    with pytest.raises(AssertionError):
        assert_close(blocked, sequential, 512)
