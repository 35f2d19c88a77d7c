"""KV-cache slot table, against both the compiled module and its pure-Python twin."""
from __future__ import annotations

from types import ModuleType

import pytest

from mdiedge.base.accel import implementations
from mdiedge.base.errors import SlotError

pytestmark = pytest.mark.twins
IMPLS = implementations("slots")


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


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


def test_twins_agree_on_a_random_workload() -> None:
    import random

    rng = random.Random(0)
    tables = [m.SlotTable(5) for m in IMPLS]
    for _ in range(500):
        sample = rng.randrange(8)
        op = rng.choice(["allocate", "free", "get_or_allocate"])
        results = []
        for t in tables:
            try:
                results.append(getattr(t, op)(sample))
            except SlotError as e:
                results.append(str(e))
        assert len(set(map(str, results))) == 1
