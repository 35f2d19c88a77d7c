"""KV-cache slot table: which row of a node's preallocated KV cache each sample holds.

Sample ids are unsigned 32-bit (they come from the wire). The lowest free slot is handed out first
and a finished sample's slot is reused. A dict finds a sample's slot and a heap the lowest free one,
so every operation but ``clear``/``assignments`` costs O(log n_slots).

Each slot knows how many positions of its KV rows are filled: a step must start there (``advance``),
so a stale or forged step (a decode at position 50 of a sample with 3 tokens in its cache) is
refused rather than run against KV rows that do not hold its past. The one way back is explicit: a
step marked ``rewind`` (speculative decoding, after the model kept fewer drafted tokens than a
verification wrote) may start at or before the filled length; the rows past its start are dead and
it overwrites them."""
from __future__ import annotations

import heapq
from typing import Dict, List, Sequence

from ..base.errors import SlotError

MAX_SAMPLE_ID = 2 ** 32 - 1


def _check_id(sample_id: int) -> None:
    if not 0 <= sample_id <= MAX_SAMPLE_ID:
        raise SlotError(f"sample id {sample_id!r} outside 0..{MAX_SAMPLE_ID}")


class SlotTable:
    def __init__(self, n_slots: int) -> None:
        if n_slots < 1:
            raise SlotError(f"a slot table needs at least one slot, got {n_slots!r}")
        self._n = int(n_slots)
        self.clear()

    @property
    def n_slots(self) -> int:
        return self._n

    @property
    def in_use(self) -> int:
        return len(self._slot)

    def allocate(self, sample_id: int) -> int:
        _check_id(sample_id)
        if sample_id in self._slot:
            raise SlotError(f"sample {sample_id} already holds a slot")
        if not self._free:
            raise SlotError(f"all {self._n} KV slots in use; cannot admit sample {sample_id}")
        slot = heapq.heappop(self._free)
        self._slot[sample_id] = slot
        self._filled[sample_id] = 0
        return slot

    def slot_of(self, sample_id: int) -> int:
        try:
            return self._slot[sample_id]
        except KeyError:
            _check_id(sample_id)
            raise SlotError(f"sample {sample_id} holds no slot") from None

    def get_or_allocate(self, sample_id: int) -> int:
        slot = self._slot.get(sample_id)
        return self.allocate(sample_id) if slot is None else slot

    def lookup(self, sample_ids: Sequence[int]) -> List[int]:
        return [self.slot_of(s) for s in sample_ids]

    def free(self, sample_id: int) -> int:
        slot = self.slot_of(sample_id)
        del self._slot[sample_id]
        self._filled.pop(sample_id, None)
        heapq.heappush(self._free, slot)
        return slot

    def clear(self) -> None:
        self._slot: Dict[int, int] = {}  # sample id -> slot
        self._filled: Dict[int, int] = {}  # sample id -> positions of its KV rows filled
        self._free: List[int] = list(range(self._n))  # a heap: the lowest free slot first

    def filled(self, sample_id: int) -> int:
        self.slot_of(sample_id)
        return self._filled[sample_id]

    def advance(self, sample_ids: Sequence[int], positions: Sequence[int], tokens: int,
                restart: bool = False, rewind: bool = False) -> None:
        """A step of ``tokens`` for each sample from its position; a SlotError, recording nothing,
        unless every position is its slot's filled length. ``restart``: position 0 starts the rows
        over (a prefill, a replay). ``rewind``: a position below the filled length too; the fill
        goes back to it."""
        for sample_id, position in zip(sample_ids, positions):
            done = 0 if restart and position == 0 else self.filled(sample_id)
            if position != done and not (rewind and 0 <= position < done):
                raise SlotError(f"sample {sample_id} at position {position} does not follow "
                                f"its KV cache ({done} positions filled): a stale or forged "
                                f"step")
        for sample_id, position in zip(sample_ids, positions):
            self._filled[sample_id] = position + tokens

    def assignments(self) -> Dict[int, int]:
        """In slot order."""
        return dict(sorted(self._slot.items(), key=lambda item: item[1]))
