"""Choosing the next token: penalties and biases, then greedy, or temperature, top-k, top-p
(nucleus, Holtzman et al. 2019) and min-p; and the log-probabilities a client may ask for.

``SamplingParams()`` samples with the defaults of :mod:`mdiedge.base.defaults` (those of
``mdiedge generate``); ``temperature=0`` is greedy, and so is any temperature below
``GREEDY_BELOW``. Each sample draws from its own generator,
seeded from (seed, sample index), so a sample's tokens do not depend on how samples are
grouped or scheduled.

A row of logits is changed first, in this order, before greedy's argmax or any filter:

- ``logit_bias``: each listed token's logit plus its bias (OpenAI's; -100 bans a token in
  practice, +100 forces it);
- ``repetition_penalty`` r (llama.cpp's ``repeat_penalty``, Hugging Face's, after Keskar et
  al. 2019): the logit of every token the sample has seen (its prompt and its output) divided
  by r where positive, multiplied by r where negative;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): logit - c * f - (c > 0) * p,
  where c counts the token in the sample's output so far.

Log-probabilities (``top_logprobs``) are those of the model's own logits, before all of
this and before temperature, as OpenAI reports them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..base.request import SamplingParams

_SEED_STRIDE = 1_000_003
History = Tuple[Sequence[int], Sequence[int]]  # a sample's prompt and its output so far


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    """The generator of one sample: independent of every other sample's."""
    return torch.Generator().manual_seed(seed * _SEED_STRIDE + sample_index)


def penalize(logits: Tensor, params: SamplingParams, prompt: Sequence[int],
             output: Sequence[int]) -> Tensor:
    """One row of logits (vocab,) with ``params``' bias and penalties applied (module
    docstring), for a sample with ``prompt`` and ``output`` so far; fp32."""
    logits = logits.detach().float().cpu().clone()
    vocab = logits.shape[-1]
    for token, bias in params.logit_bias:
        if token < vocab:
            logits[token] += bias
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if 0 <= t < vocab}),
                            dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if output and (params.frequency_penalty != 0 or params.presence_penalty != 0):
        counts = torch.bincount(torch.tensor([t for t in output if 0 <= t < vocab],
                                             dtype=torch.long), minlength=vocab).float()
        logits -= counts * params.frequency_penalty + (counts > 0).float() * \
            params.presence_penalty
    return logits


def penalize_rows(logits: Tensor, params: SamplingParams,
                  histories: Optional[Sequence[History]]) -> Tensor:
    """Rows (B, vocab), row b penalized for ``histories[b]``; as they are when ``params``
    change nothing (or no histories are given)."""
    if not params.penalized or histories is None:
        return logits
    return torch.stack([penalize(row, params, prompt, output)
                        for row, (prompt, output) in zip(logits, histories)])


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, top-p and min-p on one row of logits (vocab,); -inf
    outside."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        drop[0] = False  # always keep the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0:  # keep tokens at least min_p times as likely as the likeliest
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample_rows(logits: Tensor, params: SamplingParams,
                generators: Sequence[torch.Generator],
                histories: Optional[Sequence[History]] = None) -> List[int]:
    """One token per row of ``logits`` (B, vocab); row b draws from ``generators[b]``, its
    penalties counted on ``histories[b]`` (the sample's prompt and output so far)."""
    logits = penalize_rows(logits, params, histories)
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    rows = logits.detach().float().cpu()
    out = []
    for row, gen in zip(rows, generators):
        probs = torch.softmax(filter_logits(row, params), dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the ``top`` likeliest tokens' (id, logprob)."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


def token_logprobs(logits: Tensor, tokens: Sequence[int], top: int) -> List[TokenLogprob]:
    """Row i of ``logits`` (T, vocab) scored for ``tokens[i]`` (zip's length): the
    log-softmax of the model's logits, with the ``top`` likeliest of each row."""
    out = []
    rows = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    for row, token in zip(rows, tokens):
        best = torch.topk(row, min(top, row.shape[-1])) if top > 0 else None
        alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) \
            if best is not None else ()
        out.append(TokenLogprob(int(token), float(row[int(token)]), alternatives))
    return out
