"""numpy's BLAS computing with the node's thread count. numpy has no call for it, and
threadpoolctl is not a dependency; numpy's wheels bundle OpenBLAS (``scipy_openblas``,
symbols with a prefix and a 64-bit-interface suffix), which has one. So the library numpy
loaded is found among this process's mapped files (Linux) or in numpy's own library folder,
and its ``…set_num_threads…`` is called through ctypes, only when the count changes. Where
none is found (another BLAS, another system), nothing is set: the BLAS keeps its own count
(``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` where set before numpy loads)."""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Any, Callable, List, Optional

import numpy as np

SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
           "openblas_set_num_threads64_", "openblas_set_num_threads")
MAPS = "/proc/self/maps"
_found: List[Optional[Callable[[int], Any]]] = []
_current: List[int] = [0]


def _candidates() -> List[str]:
    """Paths of OpenBLAS libraries: those mapped into this process, then numpy's own."""
    paths: List[str] = []
    try:
        with open(MAPS) as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if "openblas" in os.path.basename(path).lower() and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    here = os.path.dirname(np.__file__)
    for folder in (os.path.join(here, ".libs"), here + ".libs", os.path.join(here, "..",
                                                                           "numpy.libs")):
        paths += sorted(glob.glob(os.path.join(folder, "*openblas*")))
    return paths


def blas_setter() -> Optional[Callable[[int], Any]]:
    """numpy's OpenBLAS ``set_num_threads``, found once; None where there is none."""
    if not _found:
        _found.append(None)
        for path in _candidates():
            try:
                library = ctypes.CDLL(path)
            except OSError:
                continue
            for name in SETTERS:
                setter = getattr(library, name, None)
                if setter is not None:
                    setter.argtypes, setter.restype = [ctypes.c_int], None
                    _found[0] = setter
                    return setter
    return _found[0]


def follow_threads(threads: int) -> bool:
    """numpy's BLAS computes with ``threads`` from now on; whether it could be set."""
    setter = blas_setter()
    if setter is None or threads < 1:
        return False
    if _current[0] != threads:
        setter(int(threads))
        _current[0] = threads
    return True
