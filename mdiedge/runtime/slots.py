"""KV-cache slot table: which row of a node's preallocated KV cache each sample holds.

Sample ids are unsigned 32-bit (they come from the wire). The lowest free slot is handed out
first and a finished sample's slot is reused. A dict finds a sample's slot and a heap the
lowest free one, so every operation but ``clear``/``assignments`` costs O(log n_slots).
"""
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
        heapq.heappush(self._free, slot)
        return slot

    def clear(self) -> None:
        self._slot: Dict[int, int] = {}  # sample id -> slot
        self._free: List[int] = list(range(self._n))  # a heap: the lowest free slot first

    def assignments(self) -> Dict[int, int]:
        """sample id -> slot for every slot in use, in slot order."""
        return dict(sorted(self._slot.items(), key=lambda item: item[1]))
