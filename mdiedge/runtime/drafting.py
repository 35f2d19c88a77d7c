"""Drafters: cheap proposals of a sample's next tokens, verified in one step (``speculation``), on
the starter, knowing a sample only by its tokens: ``NgramDrafter`` (prompt lookup: Saxena 2023,
llama.cpp's lookup, vLLM's n-gram drafter) and ``draftmodel.DraftModelDrafter`` (``draft:PATH``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..base.errors import ConfigError


@dataclass
class Proposal:
    """``q``: the distributions the tokens were drawn from after the sampling transforms
    (len(tokens), vocab); None: one-hot."""

    tokens: List[int] = field(default_factory=list)
    q: Optional[np.ndarray] = None


class Drafter(Protocol):
    """Per sample, by its ring-wide id."""

    def propose(self, sample_id: int, tokens: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` tokens to follow ``tokens``; fewer or none where the drafter has nothing."""
        ...

    def release(self, sample_id: int) -> None:
        """Nothing of the sample stays behind."""
        ...


@dataclass
class _Index:
    """Each n-gram's latest end among those ending before the last token, for n in ``sizes``."""

    done: int = 0  # n-grams ending at or before this index are in ``ends``
    ends: Dict[Tuple[int, ...], int] = field(default_factory=dict)


class NgramDrafter:
    """The longest of the last ``max_n`` .. ``min_n`` tokens occurring earlier in the text, at its
    latest occurrence, proposes what followed it there."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram sizes {min_n}..{max_n}: need 1 <= min <= max")
        self.max_n, self.min_n = max_n, min_n
        self._index: Dict[int, _Index] = {}

    def propose(self, sample_id: int, tokens: Sequence[int], k: int) -> Proposal:
        if k <= 0 or len(tokens) < 2:
            return Proposal()
        index = self._indexed(sample_id, tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return Proposal([int(t) for t in tokens[end:end + k]])
        return Proposal()

    def _indexed(self, sample_id: int, tokens: Sequence[int]) -> _Index:
        """Brought up to date; made anew when the text is shorter than indexed (a sample id reused).
        """
        index = self._index.get(sample_id)
        if index is None or index.done > len(tokens) - 1:
            index = self._index[sample_id] = _Index()
        for end in range(index.done + 1, len(tokens)):  # n-grams ending at tokens[end - 1]
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(tokens[end - n:end])] = end
        index.done = max(index.done, len(tokens) - 1)
        return index

    def release(self, sample_id: int) -> None:
        self._index.pop(sample_id, None)

    @property
    def samples(self) -> int:
        """Samples with state here (tests: a released sample leaves nothing)."""
        return len(self._index)


def parse_speculate(choice: str) -> Tuple[str, str]:
    """``ngram``, ``ngram:N`` (longest n-gram N) or ``draft:PATH``; a ConfigError quoting anything
    else."""
    kind, _, arg = choice.partition(":")
    if kind == "ngram" and (not arg or arg.isdigit() and 1 <= int(arg) <= 16):
        return kind, arg
    if kind == "draft" and arg:
        return kind, arg
    raise ConfigError(f"speculate {choice!r}: expected ngram, ngram:N (1..16) or draft:PATH")


REQUEST_SPECULATE = ("ngram", "draft", "off")  # a request's choice (the API's ``speculate``)


def request_speculate(default: Optional[str], requested: Optional[str]) -> Optional[str]:
    """``requested`` (``ngram``, ``draft``: the engine's draft model, ``off``; None: the default)
    over the engine's ``default`` (None or ``off``: none). ConfigError quoting any other, and
    ``draft`` without a draft model."""
    default = None if default in (None, "off") else default
    kind = parse_speculate(default)[0] if default is not None else None
    if requested is None:
        return default
    if requested == "off":
        return None
    if requested == "ngram":
        return default if kind == "ngram" else "ngram"
    if requested == "draft":
        if kind != "draft":
            raise ConfigError("speculate 'draft': this server has no draft model (start it "
                              "with --speculate draft:PATH)")
        return default
    raise ConfigError(f"speculate {requested!r}: expected one of "
                      f"{', '.join(REQUEST_SPECULATE)}")
