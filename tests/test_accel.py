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


def _fake_pair(name: str, failed: object) -> Twins:
    """A pair whose compiled module failed with ``failed``: ``quant``'s names (its compiled
    module is there where it is built) or ``nothing``'s (there is none)."""
    return Twins(types.ModuleType(f"mdiedge.model._py{name}"), None, failed)  # type: ignore


def _built(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"mdiedge.model._c{name}") is not None


STALE = ImportError("cannot import name 'pack_into' from 'mdiedge.model.x8layout'")
ABSENT = ImportError("cannot import name '_cnothing' from 'mdiedge.model'")


@pytest.mark.parametrize("name, failed, stale", [
    ("nothing", None, ""), ("nothing", ABSENT, ""), ("quant", None, ""),
    ("quant", STALE, "ImportError: cannot import name 'pack_into' from "
                     "'mdiedge.model.x8layout'")])
def test_a_build_from_other_sources_is_told_from_none(monkeypatch: pytest.MonkeyPatch,
                                                      name: str, failed: object,
                                                      stale: str) -> None:
    """A compiled module that is not there is "missing" (``from . import _c<name>`` fails
    with an ImportError either way); one that is there but fails its own imports (built from
    an older checkout) is stale, with the error quoted."""
    if stale and not _built(name):
        pytest.skip(f"the compiled _c{name} is not built here")
    monkeypatch.setattr(_accel, "_PAIRS", {})
    assert _fake_pair(name, failed).stale == stale


@pytest.mark.parametrize("name, failed, words", [
    ("nothing", ABSENT, ["compiled modules missing (nothing)", "pip install ."]),
    ("quant", STALE, ["built from other sources (quant: ImportError: cannot import name "
                      "'pack_into'", "build_ext --inplace"])])
def test_the_warning_says_missing_or_stale(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture, name: str,
                                          failed: object, words: list) -> None:
    if name == "quant" and not _built(name):
        pytest.skip("the compiled _cquant is not built here")
    monkeypatch.delenv("MDIEDGE_NO_EXTENSIONS", raising=False)
    monkeypatch.setattr(_accel, "_PAIRS", {})
    monkeypatch.setattr(_accel, "_warned", False)
    _fake_pair(name, failed)
    with caplog.at_level("WARNING", logger="mdiedge.accel"):
        _accel.warn_if_uncompiled()
    assert len(caplog.records) == 1
    for word in words:
        assert word in caplog.records[0].getMessage()
    status = _accel.running_code()["modules"][name]
    assert status == ("twin (stale build)" if name == "quant" else "twin")


def test_a_stale_quant_build_falls_back_and_says_why(tmp_path: Path) -> None:
    """The real case: the compiled ``_cquant`` imports a name its Python sources lost (an
    older checkout's module beside a newer build, or the reverse): the twin serves, and the
    pair says why."""
    if QUANT.compiled is None:
        pytest.skip("the compiled _cquant is not built here")
    code = ("import mdiedge.model.x8layout as x; del x.pack_into\n"
            "from mdiedge.model import kernels\n"
            "print(kernels.QUANT.compiled is None, kernels.QUANT.stale)\n")
    import subprocess
    import sys
    import mdiedge

    here = Path(mdiedge.__file__).resolve().parents[1]  # the package this process runs
    env = dict(os.environ, PYTHONPATH=str(here))
    env.pop("MDIEDGE_NO_EXTENSIONS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True ImportError: cannot import name"), out.stdout
    assert "pack_into" in out.stdout


@pytest.mark.parametrize("code, shown", [
    (None, "-"), ({"modules": "x"}, "-"),
    ({"modules": {"step": "compiled", "quant": "compiled"}}, "compiled"),
    ({"modules": {"step": "twin", "quant": "compiled"}}, "twins: step"),
    ({"modules": {"step": "twin", "quant": "twin (stale build)"}},
     "twins: quant (stale build), step")])
def test_status_names_the_twins_and_a_stale_build(code: object, shown: str) -> None:
    from mdiedge.cli.console import code_summary

    assert code_summary(code) == shown
