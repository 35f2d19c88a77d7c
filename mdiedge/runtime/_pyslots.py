"""KV-cache slot table, pure Python (twin of ``ext/_cslots.pyx``).

Maps sample ids (unsigned 32-bit, from the wire) to slot indices of a node's preallocated
KV cache; the lowest free slot is handed out first, and a finished sample's slot is reused.
"""
from __future__ import annotations

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
        self._owner: List[int] = [-1] * n_slots  # sample id holding each slot, -1 if free

    @property
    def n_slots(self) -> int:
        return len(self._owner)

    @property
    def in_use(self) -> int:
        return sum(1 for owner in self._owner if owner >= 0)

    def _find(self, sample_id: int) -> int:
        for slot, owner in enumerate(self._owner):
            if owner == sample_id:
                return slot
        return -1

    def allocate(self, sample_id: int) -> int:
        _check_id(sample_id)
        if self._find(sample_id) >= 0:
            raise SlotError(f"sample {sample_id} already holds a slot")
        for slot, owner in enumerate(self._owner):
            if owner < 0:
                self._owner[slot] = sample_id
                return slot
        raise SlotError(f"all {self.n_slots} KV slots in use; cannot admit sample {sample_id}")

    def slot_of(self, sample_id: int) -> int:
        _check_id(sample_id)
        slot = self._find(sample_id)
        if slot < 0:
            raise SlotError(f"sample {sample_id} holds no slot")
        return slot

    def get_or_allocate(self, sample_id: int) -> int:
        _check_id(sample_id)
        slot = self._find(sample_id)
        return slot if slot >= 0 else self.allocate(sample_id)

    def lookup(self, sample_ids: Sequence[int]) -> List[int]:
        return [self.slot_of(s) for s in sample_ids]

    def free(self, sample_id: int) -> int:
        slot = self.slot_of(sample_id)
        self._owner[slot] = -1
        return slot

    def clear(self) -> None:
        self._owner = [-1] * len(self._owner)

    def assignments(self) -> Dict[int, int]:
        """sample id -> slot for every slot in use."""
        return {owner: slot for slot, owner in enumerate(self._owner) if owner >= 0}
