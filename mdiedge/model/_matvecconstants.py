"""What both implementations of the few-row product (``ext/_cmatvec.pyx`` and
``mdiedge/model/_pymatvec.py``) accept: ``rows(x, weight, out, threads)`` writes ``out = x @
weight.T`` for ``x`` (rows, k), ``weight`` (n, k) and ``out`` (rows, n), all C-contiguous float32
CPU tensors (or numpy arrays), 1 <= rows <= ``MAX_ROWS``. ``usable`` says whether a call qualifies;
``check`` raises ``ValueError`` quoting what does not."""
from __future__ import annotations

from typing import Any

from ..base import defaults
from .arrays import device_of, ndim, plain, wants_grad

MAX_ROWS = defaults.DECODE_ROWS  # decode micro-batches; longer inputs (prefill) go to BLAS


def usable(x: Any, weight: Any) -> bool:
    """A 2-D float32 CPU ``x`` of at most ``MAX_ROWS`` rows against a C-contiguous float32
    CPU weight, with no gradient wanted."""
    return (ndim(x) == 2 and 1 <= x.shape[0] <= MAX_ROWS and plain(weight)
            and str(x.dtype).endswith("float32") and device_of(x) == "cpu"
            and not wants_grad(x, weight))


def check(x: Any, weight: Any, out: Any, threads: int) -> None:
    if not usable(x, weight) or not plain(x):
        raise ValueError(f"few-row product of x {tuple(x.shape)} {x.dtype} on {device_of(x)} by "
                         f"weight {tuple(weight.shape)} {weight.dtype}: needs 1..{MAX_ROWS} "
                         "contiguous float32 CPU rows and a contiguous float32 CPU weight")
    if ndim(weight) != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not take rows of {x.shape[1]}")
    if tuple(out.shape) != (x.shape[0], weight.shape[0]) or not plain(out):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous float32 "
                         f"({x.shape[0]}, {weight.shape[0]})")
    if threads < 1:
        raise ValueError(f"threads {threads} is not >= 1")
