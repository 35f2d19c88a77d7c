"""The selector of compiled modules and their twins (``mdiedge.base.accel``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from mdiedge.base import accel as _accel


def test_twins_exist_for_every_compiled_module() -> None:
    for name in _accel.TWINNED:
        assert _accel.twin(name).__name__ == f"{_accel.TWINNED[name]}._py{name}"


@pytest.mark.parametrize("value,disabled", [("", False), ("0", False), ("1", True),
                                            ("yes", True)])
def test_no_extensions_switch(monkeypatch: pytest.MonkeyPatch, value: str,
                              disabled: bool) -> None:
    monkeypatch.setenv("MDIEDGE_NO_EXTENSIONS", value)
    assert _accel.extensions_disabled() is disabled
    for name in _accel.TWINNED:
        if disabled:
            assert _accel.select(name) is _accel.twin(name)
            assert _accel.implementations(name) == [_accel.twin(name)]


def test_every_compiled_source_is_twinned() -> None:
    """``ext/_c<name>.pyx`` exists exactly for the names of TWINNED (setup.py builds those)."""
    ext = Path(__file__).resolve().parents[1] / "ext"
    if not ext.is_dir():
        pytest.skip("no ext/ in this tree")
    assert sorted(p.name for p in ext.glob("_c*.pyx")) == sorted(f"_c{n}.pyx" for n in
                                                                  _accel.TWINNED)


def test_required_extensions_are_built_and_selected() -> None:
    """CI sets ``MDIEDGE_REQUIRE_EXTENSIONS=1`` after an install that must have compiled ``ext/``:
    a source tree that shadows the installed package, or a failed build, fails here."""
    if os.environ.get("MDIEDGE_REQUIRE_EXTENSIONS", "") in ("", "0"):
        for name in _accel.TWINNED:  # not required: what is built is what is selected
            built = _accel.compiled(name)
            if built is not None and not _accel.extensions_disabled():
                assert _accel.select(name) is built, name
        return
    missing = [name for name in _accel.TWINNED if _accel.compiled(name) is None]
    assert not missing, f"not compiled: {missing} (mdiedge imported from {_accel.__file__})"
    for name in _accel.TWINNED:
        assert _accel.select(name) is _accel.compiled(name)


def test_each_twin_offers_what_its_compiled_module_does() -> None:
    """Every public name of a compiled module is its twin's too (the same API either way;
    the errors both raise come from ``mdiedge.base.errors``)."""
    import types
    for name in _accel.TWINNED:
        compiled = _accel.compiled(name)
        if compiled is None:
            continue
        public = {n for n, v in vars(compiled).items()
                  if not n.startswith("_") and not isinstance(v, types.ModuleType)
                  and not (isinstance(v, type) and issubclass(v, Exception))}
        missing = sorted(public - set(vars(_accel.twin(name))))
        assert not missing, f"{_accel.twin(name).__name__} lacks {missing}"
