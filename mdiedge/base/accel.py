"""One selector for compiled modules: ``<package>._c<name>`` (Cython, built from ``ext/``) or
its pure-Python twin ``<package>._py<name>`` with the same API, where ``TWINNED`` names the
package that owns each pair.

``MDIEDGE_NO_EXTENSIONS=1`` forces the twins; a missing compiled module falls back to its twin.
A module earns a compiled twin only where a benchmark shows it matters end to end; the others
(KV slot tables, expert grouping) have one Python implementation and are imported directly.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import List, Optional

TWINNED = {"framing": "mdiedge.runtime", "codec": "mdiedge.runtime", "matvec": "mdiedge.model",
           "step": "mdiedge.model", "quant": "mdiedge.model"}


def extensions_disabled() -> bool:
    return os.environ.get("MDIEDGE_NO_EXTENSIONS", "") not in ("", "0")


def compiled(name: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(f"{TWINNED[name]}._c{name}")
    except ImportError:
        return None


def twin(name: str) -> ModuleType:
    return importlib.import_module(f"{TWINNED[name]}._py{name}")


def select(name: str) -> ModuleType:
    """The compiled module ``name`` unless disabled or not built, else its twin."""
    if not extensions_disabled():
        module = compiled(name)
        if module is not None:
            return module
    return twin(name)


def implementations(name: str) -> List[ModuleType]:
    """Every implementation that may be selected here (for tests): twin, then compiled."""
    found = [twin(name)]
    if not extensions_disabled():
        module = compiled(name)
        if module is not None:
            found.append(module)
    return found
