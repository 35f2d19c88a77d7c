"""What a worker without its own copy of the model receives: its blocks' tensors under their
Hugging Face names as safetensors bytes, read and written with numpy (no torch)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from .cpuload import open_array_source
from .hub import resolve_model
from .modelfile import model_file
from .qtypes import kernel_qtype
from .sources import QTYPE_KEY
from .tensors import TensorSource, tensor_plan


def chunk_safetensors(model: Optional[Union[str, Path]], layers: Tuple[int, int],
                      head: bool = False, extra: Optional[Dict[str, Any]] = None,
                      extra_metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The tensors of blocks ``[layers)`` as safetensors bytes; with ``head``, the final
    norm and head too, and ``extra`` arrays as they are named (early exit's parts)."""
    from safetensors.numpy import save

    path = resolve_model(model)
    cfg = model_file(path).cfg
    source = open_array_source(path)
    metadata = dict(extra_metadata or {}, format="pt")
    try:
        plan = tensor_plan(cfg, layers, False, False)
        if head:
            plan.update(tensor_plan(cfg, (0, 0), False, True))
        tensors = {theirs: _chunk_array(source, theirs, metadata) for theirs in plan.values()}
    finally:
        source.close()
    tensors.update({name: np.ascontiguousarray(value) for name, value in (extra or {}).items()})
    return save(tensors, metadata=metadata)


def _chunk_array(source: TensorSource, name: str, metadata: Dict[str, str]) -> np.ndarray:
    """Tensor ``name`` as a chunk carries it: a kernel type's blocks as the file holds them
    (uint8, its type in ``metadata``), anything else in float32."""
    qtype = kernel_qtype(source, name)
    if qtype is None:
        return np.ascontiguousarray(source.get_array(name), dtype=np.float32)
    metadata[QTYPE_KEY + name] = qtype
    return np.ascontiguousarray(source.raw_array(name))
