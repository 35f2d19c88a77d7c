"""The model package's compiled kernels beside their pure-Python twins, each pair made once
here (``mdiedge.base.accel.Twins``) for every module that runs it: ``STEP`` (``_cstep``: the
decode step's blocks and head, a prefill's activation) and ``QUANT`` (``_cquant``: products
of quantized weights, de-quantized tiles). Torch-free, so that the CPU node's modules
(``cpumodel``, ``npprefill``) and the torch ones (``transformer``, ``qlayers``) share them."""
from __future__ import annotations

from typing import Optional

from ..base.accel import Twins
from . import _pyquant, _pystep

_step_failed: Optional[ImportError] = None
try:
    from . import _cstep
except ImportError as e:  # not built, or built from other sources: the twin serves
    _cstep, _step_failed = None, e  # type: ignore[assignment]
_quant_failed: Optional[ImportError] = None
try:
    from . import _cquant
except ImportError as e:  # not built, or built from other sources: the twin serves
    _cquant, _quant_failed = None, e  # type: ignore[assignment]

STEP = Twins(_pystep, _cstep, _step_failed)
QUANT = Twins(_pyquant, _cquant, _quant_failed)
