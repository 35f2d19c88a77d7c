"""The choice between a compiled module and its pure-Python twin, made by the package that
owns the pair.

Each compiled module ``<package>._c<name>`` (Cython, built from ``ext/_c<name>.pyx``) has a
twin ``<package>._py<name>`` beside it with the same API. The owning module imports both with
literal imports, so the import graph (tests/test_layers.py) sees them, and wraps them in a
``Twins``::

    from . import _pyframing
    try:
        from . import _cframing
    except ImportError:  # not built: the twin serves
        _cframing = None
    FRAMING = Twins(_pyframing, _cframing)

``Twins.select()`` is the compiled module unless ``MDIEDGE_NO_EXTENSIONS=1`` or it is not
built; ``Twins.implementations()`` lists what may be selected here, for tests that run both.
This module knows only that switch, no package or module name. A module earns a compiled twin
only where a benchmark shows it matters end to end; the others (KV slot tables, expert
grouping) have one Python implementation and are imported directly.
"""
from __future__ import annotations

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
    """Whether ``MDIEDGE_NO_EXTENSIONS`` forces the twins (set, and not ``0``)."""
    return os.environ.get("MDIEDGE_NO_EXTENSIONS", "") not in ("", "0")


@dataclass(frozen=True)
class Twins:
    """A pure-Python module and its compiled counterpart (None when not built)."""

    twin: ModuleType
    compiled: Optional[ModuleType] = None

    def __post_init__(self) -> None:
        _PAIRS[self.twin.__name__] = self

    @property
    def name(self) -> str:
        """The pair's short name: ``step`` of ``mdiedge.model._pystep``."""
        return self.twin.__name__.rsplit("._py", 1)[-1]

    def select(self) -> ModuleType:
        if self.compiled is not None and not extensions_disabled():
            return self.compiled
        return self.twin

    def implementations(self) -> List[ModuleType]:
        """Every implementation that may be selected here (for tests): twin, then compiled."""
        if self.compiled is not None and not extensions_disabled():
            return [self.twin, self.compiled]
        return [self.twin]


def running_code() -> Dict[str, Any]:
    """What this process runs, for a node's status: the package's directory, each pair
    imported so far by the implementation it selects (``compiled`` or ``twin``), how its
    idle OpenMP threads wait, and how its CPU kernels multiply quantized weights."""
    return {"package": package_root(), "openmp_waits": openmp_wait_mode(), "cpu_dot": cpu_dot(),
            "modules": {pair.name: "compiled" if pair.select() is pair.compiled else "twin"
                        for pair in _PAIRS.values()}}


def warn_if_uncompiled() -> None:
    """One warning per process when a pair imported so far runs its twin although the
    compiled modules were not disabled: not built (no C compiler at install), or a source tree
    imported instead of the installed package."""
    global _warned
    missing = [pair.name for pair in _PAIRS.values() if pair.compiled is None]
    if _warned or not missing or extensions_disabled():
        return
    _warned = True
    log.warning("compiled modules missing (%s): running their pure-Python twins, many times "
                "slower; mdiedge imported from %s (install it with `pip install .`, which "
                "needs a C compiler)", ", ".join(missing), package_root())
