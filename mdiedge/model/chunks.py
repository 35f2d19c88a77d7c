"""Which model chunk a node runs: on the CPU in float32 the torch-free ``CpuModel``
(``mdiedge.model.cpuload``), where the compiled step runs the model; else, or where it
refuses (one warning line naming why), the torch ``Transformer`` (``checkpoint.load_model``).
torch is imported only on the way to the torch model."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Optional, Tuple, Union

from ..base.dtypes import compute_dtype
from ..base.errors import CpuPathRefused
from ..base.torchcheck import require_torch
from .cpuload import load_cpu_model

log = logging.getLogger("mdiedge.model")
TORCH_INSTALL = "pip install 'mdiedge[torch]'"


def open_chunk(model: Optional[Union[str, Path]], layers: Optional[Tuple[int, int]],
               embedding: bool, head: bool, device: str = "cpu", dtype_name: str = "float32",
               quantize: Optional[str] = None, torch_for: Optional[str] = None) -> Any:
    """Blocks ``[layers)`` (+ embedding, + head) of ``model`` as a ``CpuModel`` on device
    cpu in float32, else (or where the CPU path refuses it and torch is installed) as the
    torch ``Transformer``. ``torch_for``: the option that needs the torch model (early exit,
    a draft model), which then loads whatever the device."""
    compute_dtype(dtype_name)  # a one-line error for an unknown name, before any load
    if torch_for is not None:
        require_torch(torch_for)
    elif device == "cpu" and compute_dtype(dtype_name).name == "float32":
        try:
            return load_cpu_model(model, layers, embedding, head, quantize)
        except CpuPathRefused as e:
            if importlib.util.find_spec("torch") is None:
                raise CpuPathRefused(f"{e} (install torch to run it: {TORCH_INSTALL})") \
                    from None
            log.warning("the torch-free CPU path cannot run this model (%s): it runs in "
                        "torch", e)
    return _torch_chunk(model, layers, embedding, head, device, dtype_name, quantize)


def _torch_chunk(model: Any, layers: Optional[Tuple[int, int]], embedding: bool, head: bool,
                 device: str, dtype_name: str, quantize: Optional[str]) -> Any:
    from .checkpoint import load_model
    from .devices import parse_dtype

    return load_model(model, layers, embedding, head, device=device,
                      dtype=parse_dtype(dtype_name), quantize=quantize)
