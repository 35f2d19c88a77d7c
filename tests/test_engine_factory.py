"""``open_engine(EngineSpec)``, the one way an engine is opened: the model's tokenizer is
loaded once, the engine answers for its nodes (``status``, links, ring size), and the worker
processes of a local ring stop with the engine's ``close``, or at once when opening fails."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest

from conftest import FakeEngine
from mdiedge.engine.opening import EngineSpec, open_engine


def test_one_process_loads_the_tokenizer_once(ring_model: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import mdiedge.engine.engine as facade

    loads: List[Any] = []
    real = facade.load_tokenizer
    monkeypatch.setattr(facade, "load_tokenizer",
                        lambda *args: loads.append(args) or real(*args))
    engine = open_engine(EngineSpec(model=ring_model))
    assert len(loads) == 1
    assert engine.ring_nodes() == 1 and engine.link_stats() == [] and engine.ring_id() is None
    [status] = engine.status()
    assert (status.role, status.name, status.layers) == ("starter", "local",
                                                          [0, engine.cfg.n_layers])
    engine.close()


class Ring:
    """Stands in for ``LocalRing``: no process, but whether it was entered and left."""

    rings: List["Ring"] = []

    def __init__(self, n_workers: int, **kwargs: Any) -> None:
        self.n_workers, self.kwargs, self.secret = n_workers, kwargs, b"s" * 32
        self.entered = self.left = False
        Ring.rings.append(self)

    def __enter__(self) -> List[Any]:
        self.entered = True
        return []

    def __exit__(self, *exc: Any) -> None:
        self.left = True


@pytest.fixture
def fake_ring(monkeypatch: pytest.MonkeyPatch) -> List[Ring]:
    import torch

    import mdiedge.roles.local_ring as local_ring

    Ring.rings = []
    monkeypatch.setattr(local_ring, "LocalRing", Ring)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave this process's alone
    return Ring.rings


class ClosingEngine(FakeEngine):
    """A ``FakeEngine`` whose ``close`` runs what ``on_close`` was given, as an engine's."""

    def on_close(self, callback: Any) -> None:
        self.closers = [callback]

    def close(self) -> None:
        for callback in self.closers:
            callback()


def test_a_local_ring_stops_with_the_engine(ring_model: Path, fake_ring: List[Ring],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import mdiedge.engine.ring as ring_module

    monkeypatch.setattr(ring_module, "RingEngine", ClosingEngine)
    engine: Any = open_engine(EngineSpec(model=ring_model, nodes=3, spares=1, respawn=True,
                                         prefill_chunk=8))
    [ring] = fake_ring
    assert ring.entered and not ring.left
    assert ring.n_workers == 2 and ring.kwargs["spares"] == 1 and ring.kwargs["respawn"]
    assert engine.options.prefill_chunk == 8 and engine.options.secret == ring.secret
    engine.close()
    assert ring.left


def test_a_ring_that_fails_to_open_stops_its_workers(ring_model: Path, fake_ring: List[Ring],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import mdiedge.engine.ring as ring_module
    from mdiedge.base.errors import RingError

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RingError("no ring")

    monkeypatch.setattr(ring_module, "RingEngine", refused)
    with pytest.raises(RingError, match="no ring"):
        open_engine(EngineSpec(model=ring_model, nodes=2))
    assert fake_ring[0].entered and fake_ring[0].left


def test_a_ring_too_large_for_the_model_starts_no_worker(ring_model: Path,
                                                          fake_ring: List[Ring]) -> None:
    from mdiedge.base.errors import PartitionError

    with pytest.raises(PartitionError, match="cannot be shared"):
        open_engine(EngineSpec(model=ring_model, nodes=40))
    assert fake_ring == []
