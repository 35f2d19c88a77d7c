"""Where and in what a model computes: device names and dtype names (from the one table in
``mdiedge.base.dtypes``) turned into torch objects, with one-line errors."""
from __future__ import annotations

import torch

from ..base.dtypes import compute_dtype
from ..base.errors import ConfigError


def parse_dtype(name: str) -> torch.dtype:
    return getattr(torch, compute_dtype(name).name)


def parse_device(name: str) -> torch.device:
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices")
    return device


def itemsize(name: str) -> int:
    return compute_dtype(name).itemsize
