"""The prompt cache: finished samples whose KV rows stay on every node, so that a request whose
prompt begins with the same tokens (the next turn of a conversation, a shared system prompt) takes
over those rows and computes only the rest of its prompt.

A parked sample keeps its ring-wide id and its KV row on every node; the tokens kept here are the
ones its rows hold, in order. A new sample that shares a prefix with them adopts the id, and its
prefill starts at the end of the shared prefix, marked ``rewind`` so each node accepts a start
before its filled length (the rows past it are overwritten). Parked rows are given back oldest first
whenever live samples need the room, and all at once when the pipeline is rebuilt or fails."""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, OrderedDict, Sequence, Tuple

from .generation import Generation, Sample
from ..base import defaults

PARKED_ENDINGS = ("eos", "stop", "length")  # a sample that ended so holds exact KV rows


@dataclass(frozen=True)
class Reuse:
    """A new sample's prefix found in the cache: the parked ``sid`` whose first ``tokens``
    KV positions it takes over."""

    sid: int
    tokens: int


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def best_reuse(prompt: Sequence[int], parked: Sequence[Tuple[int, Sequence[int]]],
               min_tokens: int) -> Optional[Reuse]:
    """The parked (sid, tokens) sharing the longest prefix with ``prompt``, when at least
    ``min_tokens`` are shared. At most ``len(prompt) - 1`` are reused: the prompt's last
    token is always computed, its result being the first new token's logits."""
    best: Optional[Reuse] = None
    for sid, tokens in parked:
        shared = min(shared_prefix(prompt, tokens), len(prompt) - 1)
        if shared >= max(1, min_tokens) and (best is None or shared > best.tokens):
            best = Reuse(sid, shared)
    return best


class PromptCache:
    """Parked samples by id, least recently used first; at most ``capacity`` of them
    (0: the cache is off)."""

    def __init__(self, capacity: int, min_tokens: int) -> None:
        self.capacity, self.min_tokens = max(0, capacity), min_tokens
        self._parked: OrderedDict[int, Tuple[int, ...]] = collections.OrderedDict()
        self.hits = self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, sid: object) -> bool:
        return sid in self._parked

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def park(self, sid: int, tokens: Sequence[int]) -> List[int]:
        """Keep ``sid``'s rows, which hold ``tokens``; the ids to give back (the oldest past
        the capacity)."""
        self._parked[sid] = tuple(tokens)
        return self.evict(len(self._parked) - self.capacity)

    def adopt(self, prompt: Sequence[int], exclude: Collection[int] = ()) -> Optional[Reuse]:
        """Take the parked rows that best serve ``prompt`` (None: no prefix worth it)."""
        candidates = [(sid, t) for sid, t in self._parked.items() if sid not in exclude]
        reuse = best_reuse(prompt, candidates, self.min_tokens)
        if reuse is not None:
            del self._parked[reuse.sid]
            self.hits += 1
            self.cached_tokens += reuse.tokens
        return reuse

    def evict(self, count: int) -> List[int]:
        """Give back the ``count`` least recently parked ids."""
        gone = []
        while count > 0 and self._parked:
            gone.append(self._parked.popitem(last=False)[0])
            count -= 1
        return gone

    def clear(self) -> List[int]:
        """Forget every parked sample; their ids."""
        gone = list(self._parked)
        self._parked.clear()
        return gone


def kv_tokens(sample: Sample) -> List[int]:
    """The tokens whose KV rows an ended ``sample`` holds: its prompt and every token it
    sampled but the last, which was never fed."""
    return sample.prompt + sample.tokens[:-1]


class SampleIds:
    """Ring-wide sample ids (1..``id_space``): new ones, and parked ones that the prompt
    cache (off until its capacity is set) lends to a new sample with their rows."""

    def __init__(self, id_space: int) -> None:
        self.id_space, self._next = id_space, 0
        self.cache = PromptCache(0, defaults.PROMPT_CACHE_MIN_TOKENS)

    def new(self) -> int:
        while True:  # never a parked sample's: its rows are another request's to adopt
            self._next = self._next % self.id_space + 1
            if self._next not in self.cache:
                return self._next

    def assign(self, generation: Generation) -> Dict[int, int]:
        """Give each sample of ``generation`` its id: a parked sample's whose rows hold a
        prefix of its prompt, else a new one; the tokens reused, by sample index."""
        reused: Dict[int, int] = {}
        for sample in generation.samples:
            reuse = self.cache.adopt(sample.prompt) if generation.cache_prompt else None
            if reuse is None:
                sample.sid = self.new()
            else:
                sample.sid, reused[sample.index] = reuse.sid, reuse.tokens
        generation.cached_tokens = max(reused.values(), default=0)
        return reused

    def park(self, generation: Generation, samples: Sequence[Sample]) -> List[int]:
        """Park the ended ``samples`` whose rows the cache keeps; the ids whose rows go
        (those it does not keep, and the oldest it gives up for them)."""
        gone: List[int] = []
        for sample in samples:
            if self.cache.enabled and generation.cache_prompt and \
                    sample.finish_reason in PARKED_ENDINGS:
                gone += self.cache.park(sample.sid, kv_tokens(sample))
            else:
                gone.append(sample.sid)
        return gone
