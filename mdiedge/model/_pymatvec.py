"""The few-row product, pure torch: the twin of ``ext/_cmatvec.pyx`` with the same API (see
``mdiedge/model/_matvecconstants.py``). One row takes BLAS's matrix-vector product; 2 to 8 rows
take ``(W @ x^T)^T``, the orientation CPU BLAS runs faster for so few rows. ``threads`` is
torch's own thread count here."""
from __future__ import annotations

from typing import Any

import torch

from ._matvecconstants import MAX_ROWS, check, usable

# the API both twins share
__all__ = ["MAX_ROWS", "TRANSPOSED_HEAD", "check", "rows", "usable"]

# BLAS streams a one-row product fastest from a head kept in transposed storage
# (``Transformer.store_head_transposed``); such a weight then takes F.linear.
TRANSPOSED_HEAD = True


def rows(x: Any, weight: Any, out: Any, threads: int) -> None:
    check(x, weight, out, threads)
    if x.shape[0] == 1:
        torch.mm(x, weight.t(), out=out)
    else:
        out.copy_((weight @ x.t()).t())
