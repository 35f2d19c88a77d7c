"""How far apart two float implementations of the same arithmetic may land, set from the
arithmetic (the dtype's epsilon, the accumulation length, the values' magnitude) rather than
from what one torch build happens to produce.

A sum of n products rounded in floating point, in any order, lies within
gamma_n * sum(|a_i * b_i|) of the exact sum, gamma_n = n*u / (1 - n*u) and u = eps / 2 the
unit roundoff (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1).
Two implementations that sum in different orders (a BLAS's blocking, vector width and
threads; a kernel of our own) each lie within that of the exact sum, so within about
n * eps * (the terms' magnitude) of each other. A chain of sums (a block's input is the last
block's output) adds its lengths: ``length`` is the sum of the reduction lengths along the
longest path to the values compared.

The bound is absolute, not relative to each value: a sum that cancels to near zero keeps the
rounding error of its terms, so a small value may differ by far more than a relative
tolerance of it allows. The largest value compared stands in for the terms' magnitude: for
terms of random sign the terms exceed their sum by about sqrt(n), while the rounding errors,
of random sign too, grow as sqrt(n) rather than the worst case's n, so the bound keeps a
margin of about sqrt(n) where a normalised network's activations are compared. A wrong
index, a missed term or a stale cache entry differs by the values' own size, far beyond it.
"""
from __future__ import annotations

from typing import Any

import torch


def tolerance(dtype: torch.dtype, length: int, magnitude: float) -> float:
    """The absolute difference two implementations of sums ``length`` long (chained sums:
    their lengths added) over terms of size ``magnitude`` may show in ``dtype``."""
    return length * torch.finfo(dtype).eps * magnitude


def assert_close(got: torch.Tensor, want: torch.Tensor, length: int) -> None:
    """``got`` within ``tolerance`` of ``want``, the magnitude being ``want``'s largest."""
    magnitude = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=0.0,
                               atol=tolerance(want.dtype, length, magnitude))


def model_path_length(cfg: Any) -> int:
    """Reduction lengths from the embedding to the logits of a decoder of shape ``cfg``
    (a ModelConfig): per block its two norms, the QKV projection, the scores, the weighted
    sum over the context, the output projection, the router and the sum over the chosen
    experts (mixture of experts) and the MLP's two products; then the final norm and the
    head."""
    attention = 2 * cfg.dim + cfg.head_dim + cfg.max_seq_len + cfg.q_dim
    mlp = 2 * cfg.dim + cfg.intermediate_size
    if cfg.n_experts:
        mlp += cfg.dim + cfg.experts_per_token
    return cfg.n_layers * (attention + mlp) + 2 * cfg.dim
