"""The choice between a compiled module and its pure-Python twin, made by the package owning the
pair. Each ``<package>._c<name>`` (from ``ext/_c<name>.pyx``) has a twin ``<package>._py<name>``
with the same API; the owner imports both literally (so tests/test_layers.py sees them)::

    from . import _pyframing
    _failed = None
    try:
        from . import _cframing
    except ImportError as e:  # not built, or built from other sources: the twin serves
        _cframing, _failed = None, e
    FRAMING = Twins(_pyframing, _cframing, _failed)

A module earns a compiled twin only where a benchmark shows it matters end to end."""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Dict, List, Optional

from .cpudot import cpu_dot
from .selfcommand import package_root
from .threads import openmp_wait_mode

log = logging.getLogger("mdiedge.accel")
_PAIRS: Dict[str, "Twins"] = {}  # every pair made in this process, by its twin's module
_warned = False


def extensions_disabled() -> bool:
    """``MDIEDGE_NO_EXTENSIONS`` set, and not ``0``."""
    return os.environ.get("MDIEDGE_NO_EXTENSIONS", "") not in ("", "0")


@dataclass(frozen=True)
class Twins:
    """``select()``: the compiled module unless disabled or not built (None); ``failed``: the
    ImportError that left it None (its owner's ``try: from . import _c<name>``), if any."""

    twin: ModuleType
    compiled: Optional[ModuleType] = None
    failed: Optional[ImportError] = None

    def __post_init__(self) -> None:
        _PAIRS[self.twin.__name__] = self

    @property
    def name(self) -> str:
        """``step`` of ``mdiedge.model._pystep``."""
        return self.twin.__name__.rsplit("._py", 1)[-1]

    @property
    def stale(self) -> str:
        """Why a built compiled module did not import (it was built from other sources: the
        package updated, not rebuilt), or "" where it is not built at all or imported."""
        e = self.failed
        if e is None or self.compiled is not None:
            return ""
        try:  # `from . import _c<name>` fails alike whether it is there or not: look for it
            built = importlib.util.find_spec(self.twin.__name__.replace("._py", "._c", 1))
        except (ImportError, ValueError):
            built = None
        return f"{type(e).__name__}: {e}" if built is not None else ""

    def select(self) -> ModuleType:
        if self.compiled is not None and not extensions_disabled():
            return self.compiled
        return self.twin

    def implementations(self) -> List[ModuleType]:
        """For tests: twin, then compiled."""
        if self.compiled is not None and not extensions_disabled():
            return [self.twin, self.compiled]
        return [self.twin]


def running_code() -> Dict[str, Any]:
    """For a node's status: the package directory, each imported pair's selection, the OpenMP wait
    mode, the CPU dot mode."""
    return {"package": package_root(), "openmp_waits": openmp_wait_mode(), "cpu_dot": cpu_dot(),
            "modules": {pair.name: "compiled" if pair.select() is pair.compiled
                        else "twin (stale build)" if pair.stale else "twin"
                        for pair in _PAIRS.values()}}


def warn_if_uncompiled() -> None:
    """Once per process when a pair runs its twin though not disabled: not built (no compiler at
    install), or a source tree imported instead of the installed package."""
    global _warned
    missing = [pair for pair in _PAIRS.values() if pair.compiled is None]
    if _warned or not missing or extensions_disabled():
        return
    _warned = True
    stale = [pair for pair in missing if pair.stale]
    if stale:
        log.warning("compiled modules built from other sources (%s: %s): running their "
                    "pure-Python twins, many times slower; rebuild mdiedge at %s (`pip install "
                    ".`, or `python setup.py build_ext --inplace` in a source tree)",
                    ", ".join(p.name for p in stale), stale[0].stale, package_root())
        return
    log.warning("compiled modules missing (%s): running their pure-Python twins, many times "
                "slower; mdiedge imported from %s (install it with `pip install .`, which "
                "needs a C compiler)", ", ".join(p.name for p in missing), package_root())
