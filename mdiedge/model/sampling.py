"""Choosing the next token: greedy, temperature, top-k and top-p (nucleus, Holtzman et al. 2019).

``SamplingParams()`` samples with the defaults of :mod:`mdiedge.base.defaults` (those of
``mdiedge generate``); ``temperature=0`` is greedy, and so is any temperature below
``GREEDY_BELOW``. Each sample draws from its own generator,
seeded from (seed, sample index), so a sample's tokens do not depend on how samples are
grouped or scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch
from torch import Tensor

from ..base import defaults
from ..base.errors import GenerationError

_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = defaults.TEMPERATURE  # 0: greedy
    top_k: int = defaults.TOP_K  # 0: no top-k filter
    top_p: float = defaults.TOP_P  # 1: no nucleus filter
    seed: int = defaults.SEED

    def __post_init__(self) -> None:
        for name, span in (("temperature", defaults.TEMPERATURE_RANGE),
                           ("top_k", defaults.TOP_K_RANGE), ("top_p", defaults.TOP_P_RANGE),
                           ("seed", defaults.SEED_RANGE)):
            value = getattr(self, name)
            if value not in span:
                raise GenerationError(f"{name}: expected {span.expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < defaults.GREEDY_BELOW or self.top_k == 1


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    """The generator of one sample: independent of every other sample's."""
    return torch.Generator().manual_seed(seed * _SEED_STRIDE + sample_index)


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p on one row of logits (vocab,); -inf outside."""
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
    return logits


def sample_rows(logits: Tensor, params: SamplingParams,
                generators: Sequence[torch.Generator]) -> List[int]:
    """One token per row of ``logits`` (B, vocab); row b draws from ``generators[b]``."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    rows = logits.detach().float().cpu()
    out = []
    for row, gen in zip(rows, generators):
        probs = torch.softmax(filter_logits(row, params), dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
