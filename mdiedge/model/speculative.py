"""Verifying drafted tokens: which of them the model keeps, and the token after them.

A drafter proposes tokens d_1..d_k after a sample's text; one step of the model scores the sample's
last token and the k drafts together, giving its logits at k + 1 positions (row i: the distribution
of the token after d_i; row 0 that after the last accepted token).

Greedy: keep the longest prefix of the drafts equal to the model's argmax at each position, then the
model's argmax after it, so the output is the one plain greedy decoding makes.

Sampling: the speculative sampling rule (Leviathan, Kalman and Matias 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling"): with p the model's and q the drafter's distribution at a
position, both after the sampling transforms (penalties, temperature, top-k, top-p, min-p of
``mdiedge.model.sampling``; the penalties of the position after draft d_i count d_1..d_i as output),
a drafted token x is kept with probability min(1, p(x) / q(x)); at the first rejection the token is
drawn from normalize(max(0, p - q)) and the rest is dropped; if every draft is kept, one more token
is drawn from p at the last position. Each emitted token is then distributed exactly as the model's
own sampling would draw it. A drafter without probabilities (prompt lookup) proposes with q one-hot
on its token. Draws come from the sample's own generator, so a seed gives the same tokens every run.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from ..base.arrays import float32
from .sampling import (Generator, History, SamplingParams, draw, filter_logits,
                       penalize_rows, softmax)


def greedy_accept(drafts: Sequence[int], argmaxes: Sequence[int]) -> List[int]:
    """The drafts up to the first differing from the model's argmax, then the argmax there
    (``argmaxes``: len(drafts) + 1)."""
    if len(argmaxes) != len(drafts) + 1:
        raise ValueError(f"{len(argmaxes)} model tokens for {len(drafts)} drafts: needs "
                         f"{len(drafts) + 1}")
    out: List[int] = []
    for drafted, chosen in zip(drafts, argmaxes):
        if drafted != chosen:
            break
        out.append(int(drafted))
    out.append(int(argmaxes[len(out)]))
    return out


def distributions(logits: Any, params: SamplingParams) -> np.ndarray:
    """Softmax after temperature, top-k and top-p (float32 numpy)."""
    return np.stack([softmax(filter_logits(row, params)) for row in float32(logits)])


def sampled_accept(drafts: Sequence[int], p: Any, q: Optional[Any],
                   generator: Generator) -> List[int]:
    """``p``: the model's distributions (len(drafts) + 1, vocab); ``q``: the drafter's at the
    drafted positions, or None for one-hot proposals. Between 1 and len(drafts) + 1 tokens."""
    k = len(drafts)
    p = float32(p)
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"model distributions {tuple(p.shape)} for {k} drafts: needs "
                         f"({k + 1}, vocab)")
    if q is not None:
        q = float32(q)
        if tuple(q.shape) != (k, p.shape[1]):
            raise ValueError(f"draft distributions {tuple(q.shape)} for {k} drafts of a "
                             f"vocabulary of {p.shape[1]}")
    out: List[int] = []
    for i, drafted in enumerate(drafts):
        x = int(drafted)
        q_row = q[i] if q is not None else _one_hot(x, p.shape[1])
        ratio = float(p[i, x]) / float(q_row[x]) if float(q_row[x]) > 0 else 0.0
        if generator.random() < min(1.0, ratio):
            out.append(x)
            continue
        out.append(_draw(np.maximum(p[i] - q_row, 0.0), p[i], generator))
        return out
    out.append(_draw(p[k], p[k], generator))
    return out


def accept(drafts: Sequence[int], logits: Any, q: Optional[Any],
           params: SamplingParams, generator: Generator,
           history: Optional[History] = None) -> List[int]:
    """Greedy or sampled as ``params`` say; ``logits``: raw, at len(drafts) + 1 positions;
    ``history``: prompt and output before them (penalties)."""
    logits = float32(logits)
    if history is not None and params.penalized:
        prompt, output = history
        logits = penalize_rows(logits, params, [(prompt, list(output) + list(drafts[:i]))
                                                for i in range(len(drafts) + 1)])
    if params.greedy:
        return greedy_accept(drafts, [int(t) for t in logits.argmax(axis=-1)])
    return sampled_accept(drafts, distributions(logits, params), q, generator)


def _one_hot(token: int, vocab: int) -> np.ndarray:
    row = np.zeros(vocab, dtype=np.float32)
    row[token] = 1.0
    return row


def _draw(weights: np.ndarray, fallback: np.ndarray, generator: Generator) -> int:
    """From ``fallback`` where ``weights`` sum to 0 (p equal to q: a rejection there has probability
    0, rounding aside)."""
    if float(weights.sum()) <= 0.0:
        weights = fallback
    return draw(weights, generator)
