"""The threads numpy's BLAS computes with (the torch-free prefill keeps it at one and
splits its products among the node's threads itself: OpenBLAS's own threads spin after each
call, against the compiled kernels' OpenMP threads). numpy has no call for it, and
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
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

PREFIXES = ("scipy_openblas", "openblas")
SUFFIXES = ("64_", "")
MAPS = "/proc/self/maps"
_found: List[Optional[Tuple[Callable[[int], Any], Callable[[], int]]]] = []
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


def blas_calls() -> Optional[Tuple[Callable[[int], Any], Callable[[], int]]]:
    """numpy's OpenBLAS ``set_num_threads`` and ``get_num_threads``, found once; None
    where there are none."""
    if not _found:
        _found.append(None)
        for path in _candidates():
            try:
                library = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix in PREFIXES:
                for suffix in SUFFIXES:
                    setter = getattr(library, f"{prefix}_set_num_threads{suffix}", None)
                    getter = getattr(library, f"{prefix}_get_num_threads{suffix}", None)
                    if setter is not None and getter is not None:
                        setter.argtypes, setter.restype = [ctypes.c_int], None
                        getter.argtypes, getter.restype = [], ctypes.c_int
                        _found[0] = (setter, getter)
                        return _found[0]
    return _found[0]


def blas_threads() -> int:
    """The threads numpy's BLAS computes with; 0 where it is not known here."""
    calls = blas_calls()
    return int(calls[1]()) if calls is not None else 0


def follow_threads(threads: int) -> bool:
    """numpy's BLAS computes with ``threads`` from now on; whether it could be set."""
    calls = blas_calls()
    if calls is None or threads < 1:
        return False
    if _current[0] != threads:
        calls[0](int(threads))
        _current[0] = threads
    return True
