"""KV-cache slot table (``mdiedge.runtime.slots``): lowest free slot first, clear errors, and
the same answers as a plain list scan on a random workload."""
from __future__ import annotations

import random
from types import ModuleType
from typing import List

import pytest

from mdiedge.base.errors import SlotError
from mdiedge.runtime import slots


@pytest.fixture
def impl() -> ModuleType:
    return slots


def test_allocate_free_reuse(impl: ModuleType) -> None:
    table = impl.SlotTable(3)
    assert [table.allocate(s) for s in (10, 11, 12)] == [0, 1, 2]
    assert table.in_use == 3 and table.n_slots == 3
    assert table.free(11) == 1
    assert table.allocate(99) == 1  # lowest free slot is reused
    assert table.lookup([12, 10, 99]) == [2, 0, 1]
    assert table.assignments() == {10: 0, 99: 1, 12: 2}
    assert table.get_or_allocate(12) == 2
    table.clear()
    assert table.in_use == 0


@pytest.mark.parametrize("action,message", [
    (lambda t: [t.allocate(1), t.allocate(2), t.allocate(3)],
     "all 2 KV slots in use; cannot admit sample 3"),
    (lambda t: [t.allocate(1), t.allocate(1)], "sample 1 already holds a slot"),
    (lambda t: t.free(5), "sample 5 holds no slot"),
    (lambda t: t.slot_of(7), "sample 7 holds no slot"),
    (lambda t: t.allocate(-1), "sample id -1 outside 0..4294967295"),
    (lambda t: t.allocate(2 ** 32), "sample id 4294967296 outside 0..4294967295"),
])
def test_misuse_is_a_clear_error(impl: ModuleType, action, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SlotError) as e:
        action(impl.SlotTable(2))
    assert str(e.value) == message


def test_no_slots(impl: ModuleType) -> None:
    with pytest.raises(SlotError, match="at least one slot, got 0"):
        impl.SlotTable(0)


class ListTable:
    """The specification: a list of owners scanned from slot 0 (-1 for a free slot)."""

    def __init__(self, n_slots: int) -> None:
        self.owner: List[int] = [-1] * n_slots

    def allocate(self, sample_id: int) -> int:
        if sample_id in self.owner:
            raise SlotError(f"sample {sample_id} already holds a slot")
        if -1 not in self.owner:
            raise SlotError(f"all {len(self.owner)} KV slots in use; "
                            f"cannot admit sample {sample_id}")
        slot = self.owner.index(-1)
        self.owner[slot] = sample_id
        return slot

    def free(self, sample_id: int) -> int:
        if sample_id not in self.owner:
            raise SlotError(f"sample {sample_id} holds no slot")
        slot = self.owner.index(sample_id)
        self.owner[slot] = -1
        return slot

    def get_or_allocate(self, sample_id: int) -> int:
        return (self.owner.index(sample_id) if sample_id in self.owner
                else self.allocate(sample_id))

    def assignments(self) -> dict:  # type: ignore[type-arg]
        return {o: s for s, o in enumerate(self.owner) if o >= 0}


def test_a_random_workload_matches_a_list_scan() -> None:
    rng = random.Random(0)
    table, spec = slots.SlotTable(5), ListTable(5)
    for _ in range(2000):
        sample = rng.randrange(8)
        op = rng.choice(["allocate", "free", "get_or_allocate"])
        results = []
        for t in (table, spec):
            try:
                results.append(getattr(t, op)(sample))
            except SlotError as e:
                results.append(str(e))
        assert results[0] == results[1], (op, sample)
        assert list(table.assignments().items()) == list(spec.assignments().items())
        assert table.in_use == len(spec.assignments())



def test_a_step_must_follow_its_slots_filled_length() -> None:
    table = slots.SlotTable(2)
    table.allocate(7)
    table.advance([7], [0], 3, restart=True)  # a prompt of 3
    with pytest.raises(SlotError, match=r"sample 7 at position 50 does not follow its KV "
                                        r"cache \(3 positions filled\)"):
        table.advance([7], [50], 1)
    with pytest.raises(SlotError, match="at position 1 does not follow"):  # no going back
        table.advance([7], [1], 1)
    table.advance([7], [3], 1)
    assert table.filled(7) == 4
    table.allocate(8)
    with pytest.raises(SlotError, match="sample 8 at position 2"):  # nothing recorded
        table.advance([7, 8], [4, 2], 1)
    assert (table.filled(7), table.filled(8)) == (4, 0)
    table.advance([7], [0], 2, restart=True)  # a replay starts the rows over
    assert table.filled(7) == 2
    table.free(7)
    table.allocate(7)
    assert table.filled(7) == 0
