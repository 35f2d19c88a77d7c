"""Compiled modules and their twins: each pair chosen by the package that owns it
(``mdiedge.base.accel.Twins``), ``MDIEDGE_NO_EXTENSIONS`` obeyed, the same API either way."""
from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Dict

import pytest

from mdiedge.base import accel as _accel
from mdiedge.base.accel import Twins
from mdiedge.model.layers import MATVEC
from mdiedge.model.qlayers import QUANT
from mdiedge.model.transformer import STEP
from mdiedge.runtime.framing import CODEC, FRAMING

REPO = Path(__file__).resolve().parents[1]
PAIRS: Dict[str, Twins] = {"framing": FRAMING, "codec": CODEC, "matvec": MATVEC, "step": STEP,
                           "quant": QUANT}


def _package(module: types.ModuleType) -> str:
    return module.__name__.rpartition(".")[0]


def test_each_pair_lives_in_one_package() -> None:
    """``<package>._py<name>`` and ``<package>._c<name>``, side by side."""
    for name, pair in PAIRS.items():
        assert pair.twin.__name__.endswith(f"._py{name}"), pair.twin.__name__
        if pair.compiled is not None:
            assert pair.compiled.__name__ == f"{_package(pair.twin)}._c{name}"


@pytest.mark.parametrize("value,disabled", [("", False), ("0", False), ("1", True),
                                            ("yes", True)])
def test_no_extensions_switch(monkeypatch: pytest.MonkeyPatch, value: str,
                              disabled: bool) -> None:
    monkeypatch.setenv("MDIEDGE_NO_EXTENSIONS", value)
    assert _accel.extensions_disabled() is disabled
    twin, compiled = types.ModuleType("twin"), types.ModuleType("compiled")
    assert Twins(twin, compiled).select() is (twin if disabled else compiled)
    assert Twins(twin, compiled).implementations() == ([twin] if disabled else [twin, compiled])
    assert Twins(twin, None).select() is twin and Twins(twin).implementations() == [twin]
    for pair in PAIRS.values():
        if disabled:
            assert pair.select() is pair.twin
            assert pair.implementations() == [pair.twin]


def test_every_compiled_source_is_twinned() -> None:
    """``ext/_c<name>.pyx`` exists exactly for the pairs, and setup.py finds each one's package
    as the one folder that holds ``_py<name>.py``."""
    ext = REPO / "ext"
    if not ext.is_dir():
        pytest.skip("no ext/ in this tree")
    assert sorted(p.name for p in ext.glob("_c*.pyx")) == sorted(f"_c{n}.pyx" for n in PAIRS)
    for name, pair in PAIRS.items():
        found = sorted((REPO / "mdiedge").rglob(f"_py{name}.py"))
        packages = [".".join(p.parent.relative_to(REPO).parts) for p in found]
        assert packages == [_package(pair.twin)], name


def test_required_extensions_are_built_and_selected() -> None:
    """CI sets ``MDIEDGE_REQUIRE_EXTENSIONS=1`` after an install that must have compiled ``ext/``:
    a source tree that shadows the installed package, or a failed build, fails here."""
    if os.environ.get("MDIEDGE_REQUIRE_EXTENSIONS", "") in ("", "0"):
        for name, pair in PAIRS.items():  # not required: what is built is what is selected
            if pair.compiled is not None and not _accel.extensions_disabled():
                assert pair.select() is pair.compiled, name
        return
    missing = [name for name, pair in PAIRS.items() if pair.compiled is None]
    assert not missing, f"not compiled: {missing} (mdiedge imported from {_accel.__file__})"
    for pair in PAIRS.values():
        assert pair.select() is pair.compiled


def test_each_twin_offers_what_its_compiled_module_does() -> None:
    """Every public name of a compiled module is its twin's too (the same API either way;
    the errors both raise come from ``mdiedge.base.errors``)."""
    for pair in PAIRS.values():
        if pair.compiled is None:
            continue
        public = {n for n, v in vars(pair.compiled).items()
                  if not n.startswith("_") and not isinstance(v, types.ModuleType)
                  and not (isinstance(v, type) and issubclass(v, Exception))}
        missing = sorted(public - set(vars(pair.twin)))
        assert not missing, f"{pair.twin.__name__} lacks {missing}"
