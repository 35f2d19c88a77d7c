"""The model package's compiled kernels beside their pure-Python twins, each pair made once
here (``mdiedge.base.accel.Twins``) for every module that runs it: ``STEP`` (``_cstep``: the
decode step's blocks and head, a prefill's activation) and ``QUANT`` (``_cquant``: products
of quantized weights, de-quantized tiles). Torch-free, so that the CPU node's modules
(``cpumodel``, ``npprefill``) and the torch ones (``transformer``, ``qlayers``) share them."""
from __future__ import annotations

from ..base.accel import Twins
from . import _pyquant, _pystep

try:
    from . import _cstep
except ImportError:  # not built: the twin serves
    _cstep = None  # type: ignore[assignment]
try:
    from . import _cquant
except ImportError:  # not built: the twin serves
    _cquant = None  # type: ignore[assignment]

STEP = Twins(_pystep, _cstep)
QUANT = Twins(_pyquant, _cquant)
