"""Arrays as the runtime holds them: C-contiguous numpy arrays, whatever made them.

A torch tensor is recognised by its methods, never by importing torch (a CPU node runs without it):
a CPU tensor is viewed through ``.numpy()`` (no copy), one on another device is copied to the CPU
first. bfloat16, which numpy lacks, travels as its raw 16-bit words (uint16) and is widened to
float32 by shifting where numpy must compute on it."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

BF16_WORDS = np.dtype(np.uint16)  # a bfloat16 array seen by numpy: its raw words


def is_torch(array: Any) -> bool:
    """Whether ``array`` is a torch tensor (torch imported already: something made it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


def is_bf16(array: Any) -> bool:
    """A torch bfloat16 tensor (numpy has no such dtype)."""
    return is_torch(array) and str(array.dtype) == "torch.bfloat16"


def to_numpy(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous numpy array sharing its memory where it can: a torch
    tensor through ``.numpy()`` (moved to the CPU and detached first; a bfloat16 one as
    uint16 words), anything else through ``np.ascontiguousarray``."""
    if is_torch(array):
        tensor = array.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        if is_bf16(tensor):
            return tensor.view(sys.modules["torch"].int16).numpy().view(BF16_WORDS)
        return tensor.numpy()
    return np.ascontiguousarray(array)


def widen_bf16(words: np.ndarray) -> np.ndarray:
    """bfloat16 words (uint16) as float32 (exact: bfloat16 is float32's upper half)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def float32(array: Any) -> np.ndarray:
    """``array`` as C-contiguous float32 numpy (bfloat16 words widened; no copy where it is
    so already)."""
    out = to_numpy(array)
    if out.dtype == BF16_WORDS:
        return widen_bf16(out)
    return np.ascontiguousarray(out, dtype=np.float32)
