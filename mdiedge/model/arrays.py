"""What the compiled kernels' boundaries ask of an array, for numpy arrays and torch tensors
alike, without importing torch: a torch tensor is recognised only where torch is already
loaded (whoever made one imported it). How the runtime holds arrays: ``mdiedge.base.arrays``."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..base.arrays import is_torch


def dtype_name(a: Any) -> str:
    """``a``'s element type as numpy names it ("float32", "uint8", "int64"), "" if none."""
    dtype = getattr(a, "dtype", None)
    if dtype is None:
        return ""
    if is_torch(a):
        return str(dtype).replace("torch.", "")
    return np.dtype(dtype).name if isinstance(dtype, np.dtype) else ""


def contiguous_cpu(a: Any, dtype: str) -> bool:
    """A C-contiguous array (numpy) or CPU tensor (torch) of element type ``dtype``."""
    if isinstance(a, np.ndarray):
        return a.dtype == np.dtype(dtype) and a.flags.c_contiguous
    if is_torch(a):
        return dtype_name(a) == dtype and a.device.type == "cpu" and a.is_contiguous()
    return False


def row_stride(a: Any) -> int:
    """Elements from one row of the 2-D CPU array or tensor ``a`` to the next where each row
    is contiguous (its last stride one element) and the rows do not overlap, else 0."""
    if isinstance(a, np.ndarray):
        if a.ndim != 2 or a.strides[1] != a.itemsize or a.strides[0] % a.itemsize:
            return 0
        stride = a.strides[0] // a.itemsize
    elif is_torch(a) and a.dim() == 2 and a.device.type == "cpu" and a.stride(1) == 1:
        stride = a.stride(0)
    else:
        return 0
    return stride if stride >= a.shape[1] or a.shape[0] == 1 else 0


def plain(a: Any) -> bool:
    """A contiguous float32 array on the CPU, as the step reads every tensor."""
    return contiguous_cpu(a, "float32")


def ndim(a: Any) -> int:
    return len(getattr(a, "shape", ()))


def device_of(a: Any) -> str:
    """Where ``a`` lies, in words ("cpu" for numpy)."""
    device = getattr(a, "device", None)
    return "cpu" if device is None or isinstance(a, np.ndarray) else str(device)


def wants_grad(*arrays: Any) -> bool:
    """Whether autograd records a product of ``arrays`` (torch tensors needing gradients,
    with gradients enabled); never for numpy arrays."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return False
    return any(getattr(a, "requires_grad", False) for a in arrays if a is not None)


def address(a: Any) -> int:
    """The address of ``a``'s first element: a tensor's ``data_ptr()``, an array's buffer."""
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.data_ptr())


def numpy_view(a: Any) -> np.ndarray:
    """``a`` as a numpy array sharing its memory (a CPU tensor through ``.numpy()``)."""
    if isinstance(a, np.ndarray):
        return a
    if is_torch(a):
        return a.detach().numpy()
    return np.asarray(a)


def grad_enabled() -> bool:
    """Whether torch is loaded and records gradients (never without torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.is_grad_enabled())
