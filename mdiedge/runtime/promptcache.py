"""The prompt cache: finished samples whose KV rows stay on every node, so a request whose prompt
begins with the same tokens (a conversation's next turn, a shared system prompt) takes those rows
over and computes only the rest.

A parked sample keeps its ring-wide id and rows; the tokens kept here are those its rows hold. A new
sample sharing a prefix adopts the id, its prefill starting at the prefix's end marked ``rewind``
(each node accepts a start before its filled length). Parked rows are given back oldest first when
live samples need room, and all at once when the pipeline is rebuilt or fails."""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass, replace
from typing import Collection, Dict, List, Optional, OrderedDict, Sequence, Tuple

from .generation import Generation, Sample
from ..base import defaults

PARKED_ENDINGS = ("eos", "stop", "length")  # a sample that ended so holds exact KV rows


Runs = Tuple[Tuple[int, int], ...]  # a sample's rows computed as a prefill (Sample.runs)


@dataclass(frozen=True)
class Reuse:
    """The parked ``sid`` whose first ``tokens`` KV positions a new sample takes over, with the
    prefill runs that computed them (``runs_within``)."""

    sid: int
    tokens: int
    runs: Runs = ()


def runs_within(runs: Sequence[Tuple[int, int]], tokens: int) -> Runs:
    """The runs of the first ``tokens`` rows: a run the end cuts keeps its rows before the cut (a
    replay cannot repeat it whole, and computes them as one run of their own)."""
    return tuple((start, min(end, tokens)) for start, end in runs if start < tokens)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def best_reuse(prompt: Sequence[int], parked: Sequence[Tuple[int, Sequence[int]]],
               min_tokens: int) -> Optional[Reuse]:
    """The parked (sid, tokens) sharing the longest prefix, at least ``min_tokens``; at most
    ``len(prompt) - 1`` reused: the last prompt token is always computed (its result gives the first
    new token)."""
    best: Optional[Reuse] = None
    for sid, tokens in parked:
        shared = min(shared_prefix(prompt, tokens), len(prompt) - 1)
        if shared >= max(1, min_tokens) and (best is None or shared > best.tokens):
            best = Reuse(sid, shared)
    return best


class PromptCache:
    """Least recently used first, at most ``capacity`` (0: off)."""

    def __init__(self, capacity: int, min_tokens: int) -> None:
        self.capacity, self.min_tokens = max(0, capacity), min_tokens
        # each parked id's tokens and the prefill runs that computed its rows
        self._parked: OrderedDict[int, Tuple[Tuple[int, ...], Runs]] = collections.OrderedDict()
        self.hits = self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, sid: object) -> bool:
        return sid in self._parked

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def park(self, sid: int, tokens: Sequence[int], runs: Runs = ()) -> List[int]:
        """The ids to give back (oldest past the capacity)."""
        self._parked[sid] = (tuple(tokens), tuple(runs))
        return self.evict(len(self._parked) - self.capacity)

    def adopt(self, prompt: Sequence[int], exclude: Collection[int] = ()) -> Optional[Reuse]:
        """None: no prefix worth it."""
        candidates = [(sid, t) for sid, (t, _) in self._parked.items() if sid not in exclude]
        reuse = best_reuse(prompt, candidates, self.min_tokens)
        if reuse is not None:
            _, runs = self._parked.pop(reuse.sid)
            reuse = replace(reuse, runs=runs_within(runs, reuse.tokens))
            self.hits += 1
            self.cached_tokens += reuse.tokens
        return reuse

    def evict(self, count: int) -> List[int]:
        gone = []
        while count > 0 and self._parked:
            gone.append(self._parked.popitem(last=False)[0])
            count -= 1
        return gone

    def clear(self) -> List[int]:
        """Their ids."""
        gone = list(self._parked)
        self._parked.clear()
        return gone


def kv_tokens(sample: Sample) -> List[int]:
    """Its prompt and every sampled token but the last, which was never fed."""
    return sample.prompt + sample.tokens[:-1]


class SampleIds:
    """Ring-wide ids (1..``id_space``): new ones, and parked ones the prompt cache lends with their
    rows."""

    def __init__(self, id_space: int) -> None:
        self.id_space, self._next = id_space, 0
        self.cache = PromptCache(0, defaults.PROMPT_CACHE_MIN_TOKENS)

    def new(self) -> int:
        while True:  # never a parked sample's: its rows are another request's to adopt
            self._next = self._next % self.id_space + 1
            if self._next not in self.cache:
                return self._next

    def assign(self, generation: Generation) -> Dict[int, int]:
        """A parked id whose rows hold a prefix of the prompt, else a new one; tokens reused by
        sample index."""
        reused: Dict[int, int] = {}
        for sample in generation.samples:
            reuse = self.cache.adopt(sample.prompt) if generation.cache_prompt else None
            if reuse is None:
                sample.sid, sample.runs = self.new(), []
            else:
                sample.sid, reused[sample.index] = reuse.sid, reuse.tokens
                sample.runs = list(reuse.runs)
        generation.cached_tokens = max(reused.values(), default=0)
        return reused

    def park(self, generation: Generation, samples: Sequence[Sample]) -> List[int]:
        """The ids whose rows go (those not kept, and the oldest given up for them)."""
        gone: List[int] = []
        for sample in samples:
            if self.cache.enabled and generation.cache_prompt and \
                    sample.finish_reason in PARKED_ENDINGS:
                gone += self.cache.park(sample.sid, kv_tokens(sample), tuple(sample.runs))
            else:
                gone.append(sample.sid)
        return gone
