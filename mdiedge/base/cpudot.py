"""How this process's CPU kernels multiply quantized weights: ``q8`` (each activation row
quantized to 8 bits per block, once per product, and multiplied with the weights' quants in
integer dot products, as llama.cpp's CPU path does) or ``f32`` (each block's quants widened to
float32 and multiplied with the float32 activations: the exact path the transformers-equality
tests use). Float32 weights and CUDA (the Jetson FP32 rule) ignore it.

One mode per process (a node), chosen at start: ``--cpu-dot``, the config's ``cpu_dot``,
else ``$MDIEDGE_CPU_DOT``, else ``defaults.CPU_DOT``; a mode set is exported to
``$MDIEDGE_CPU_DOT``, so the processes this one starts (a local ring's workers, a benchmark's
runs) take it too. Needs no torch."""
from __future__ import annotations

import os
from typing import Optional

from .defaults import CPU_DOT, CPU_DOTS
from .errors import ConfigError

ENV = "MDIEDGE_CPU_DOT"
CODES = {"f32": 0, "q8": 1}  # the compiled kernels' ``dot`` argument

_chosen: Optional[str] = None


def check_cpu_dot(mode: object, what: str = "--cpu-dot") -> str:
    """``mode`` if it is one of ``CPU_DOTS``, else a ``ConfigError`` naming ``what``."""
    if mode not in CPU_DOTS:
        raise ConfigError(f"{what}: expected one of {', '.join(CPU_DOTS)}, got {mode!r}")
    return str(mode)


def set_cpu_dot(mode: Optional[str]) -> str:
    """This process's mode from now on (None: back to the environment's or the default);
    returns the mode in force."""
    global _chosen
    _chosen = None if mode is None else check_cpu_dot(mode)
    if _chosen is not None:
        os.environ[ENV] = _chosen
    return cpu_dot()


def cpu_dot() -> str:
    """The mode in force: the one set, else ``$MDIEDGE_CPU_DOT``, else the default."""
    if _chosen is not None:
        return _chosen
    return check_cpu_dot(os.environ.get(ENV, CPU_DOT), f"${ENV}")


def dot_code() -> int:
    """The mode in force as the compiled kernels' ``dot`` argument."""
    return CODES[cpu_dot()]
