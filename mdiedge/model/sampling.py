"""Choosing the next token: penalties and biases, then greedy, or temperature, top-k, top-p
(nucleus, Holtzman et al. 2019) and min-p; and the log-probabilities a client may ask for.

``temperature`` below ``GREEDY_BELOW`` is greedy. Each sample draws from its own generator, seeded
from (seed, sample index), so its tokens do not depend on how samples are grouped or scheduled.

A row of logits is changed first, in this order, before greedy's argmax or any filter:

- ``logit_bias``: each listed token's logit plus its bias (OpenAI's; -100 bans, +100 forces);
- ``repetition_penalty`` r (llama.cpp's ``repeat_penalty``, Keskar et al. 2019): the logit of
  every token of the prompt and output divided by r where positive, multiplied where negative;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): logit - c * f - (c > 0) * p,
  c counting the token in the output so far.

Log-probabilities (``top_logprobs``) are of the model's own logits, before all this and before
temperature, as OpenAI reports them. Logits are numpy float32 rows: no torch here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..base.arrays import float32
from ..base.request import SamplingParams

_SEED_STRIDE = 1_000_003
History = Tuple[Sequence[int], Sequence[int]]  # a sample's prompt and its output so far


class Generator:
    """numpy's ``Generator`` over ``PCG64(seed)``, made at the first draw, so a greedy run leaves
    ``numpy.random`` (and the OpenSSL it loads) out of memory."""

    __slots__ = ("seed", "_made")

    def __init__(self, seed: int) -> None:
        self.seed, self._made = seed, None

    def random(self) -> float:
        if self._made is None:
            self._made = np.random.Generator(np.random.PCG64(self.seed))
        return self._made.random()


def sample_generator(seed: int, sample_index: int) -> Generator:
    """Independent of every other sample's."""
    return Generator(seed * _SEED_STRIDE + sample_index)


def penalize(logits: Any, params: SamplingParams, prompt: Sequence[int],
             output: Sequence[int]) -> np.ndarray:
    """A float32 copy of one row with ``params``' bias and penalties applied (module docstring)."""
    logits = np.array(float32(logits), dtype=np.float32)
    vocab = logits.shape[-1]
    for token, bias in params.logit_bias:
        if token < vocab:
            logits[token] += np.float32(bias)
    if params.repetition_penalty != 1:
        seen = np.array(sorted({t for t in (*prompt, *output) if 0 <= t < vocab}),
                        dtype=np.int64)
        values = logits[seen]
        r = np.float32(params.repetition_penalty)
        logits[seen] = np.where(values > 0, values / r, values * r)
    if output and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        counts = np.bincount(np.array([t for t in output if 0 <= t < vocab], dtype=np.int64),
                             minlength=vocab).astype(np.float32)
        logits -= counts * np.float32(params.frequency_penalty) + \
            (counts > 0).astype(np.float32) * np.float32(params.presence_penalty)
    return logits


def penalize_rows(logits: Any, params: SamplingParams,
                  histories: Optional[Sequence[History]]) -> np.ndarray:
    """Row b penalized for ``histories[b]``; as they are when ``params`` change nothing."""
    logits = float32(logits)
    if not params.penalized or histories is None:
        return logits
    return np.stack([penalize(row, params, prompt, output)
                     for row, (prompt, output) in zip(logits, histories)])


def softmax(logits: np.ndarray) -> np.ndarray:
    """Over the last axis, float32; -inf gives 0."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def filter_logits(logits: Any, params: SamplingParams) -> np.ndarray:
    """Temperature, then top-k, top-p and min-p on one row; -inf outside."""
    logits = float32(logits) / np.float32(params.temperature)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(logits, vocab - params.top_k)[vocab - params.top_k]
        logits = np.where(logits < kth, np.float32(-np.inf), logits)
    if params.top_p < 1.0:
        logits = nucleus(logits, params.top_p)
    if params.min_p > 0:  # keep tokens at least min_p times as likely as the likeliest
        probs = softmax(logits)
        logits = np.where(probs < params.min_p * probs.max(), np.float32(-np.inf), logits)
    return logits


def nucleus(logits: np.ndarray, top_p: float) -> np.ndarray:
    """-inf past the smallest set of likeliest tokens reaching ``top_p`` (ties: lower id first).
    Only tokens of probability >= (1 - top_p) / (2 vocab) are sorted: those below hold less than
    half of 1 - top_p, so the set lies among the others, and sorting a whole vocabulary costs
    milliseconds."""
    probs, vocab = softmax(logits), logits.shape[-1]
    candidates = np.flatnonzero(probs >= (1.0 - top_p) / (2 * vocab))
    order = candidates[np.lexsort((candidates, -probs[candidates]))]
    cumulative = np.cumsum(probs[order])
    kept = order[cumulative - probs[order] < top_p]
    out = np.full(vocab, -np.inf, dtype=np.float32)
    out[order[0]] = logits[order[0]]  # always keep the most likely token
    out[kept] = logits[kept]
    return out


def draw(weights: np.ndarray, generator: Generator) -> int:
    """The inverse of the running sum of the positive ``weights`` at one uniform draw."""
    indices = np.flatnonzero(weights > 0)
    cumulative = np.cumsum(weights[indices], dtype=np.float64)
    point = generator.random() * cumulative[-1]
    return int(indices[min(np.searchsorted(cumulative, point, side="right"), len(indices) - 1)])


def sample_rows(logits: Any, params: SamplingParams, generators: Sequence[Generator],
                histories: Optional[Sequence[History]] = None) -> List[int]:
    """Row b draws from ``generators[b]``, its penalties counted on ``histories[b]``."""
    rows = penalize_rows(logits, params, histories)
    if params.greedy:
        return [int(t) for t in rows.argmax(axis=-1)]
    return [draw(softmax(filter_logits(row, params)), gen)
            for row, gen in zip(rows, generators)]


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the ``top`` likeliest (id, logprob)."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


def top_entries(row: np.ndarray, top: int) -> Tuple[Tuple[int, float], ...]:
    """(index, value), largest first (ties: lower index first)."""
    top = min(top, row.shape[-1])
    if top <= 0:
        return ()
    best = np.argpartition(-row, top - 1)[:top]
    best = best[np.lexsort((best, -row[best]))]
    return tuple((int(i), float(row[i])) for i in best)


def token_logprobs(logits: Any, tokens: Sequence[int], top: int) -> List[TokenLogprob]:
    """Row i scored for ``tokens[i]``: log-softmax of the model's logits, with each row's ``top``
    likeliest."""
    rows = log_softmax(float32(logits))
    return [TokenLogprob(int(token), float(row[int(token)]), top_entries(row, top))
            for row, token in zip(rows, tokens)]
