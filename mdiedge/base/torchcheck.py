"""torch is optional: a CPU node runs without it. What needs it (CUDA, other dtypes, early
exit, a draft model, training, the torch-based tools) asks for it here, and a machine without
torch gets one line naming what needs it and how to install it, never a traceback."""
from __future__ import annotations

from typing import Any, Optional

from . import interrupts, threads
from .errors import TorchMissing

INSTALL = "pip install 'mdiedge[torch]'"


def torch_missing(what: str) -> TorchMissing:
    return TorchMissing(f"{what} needs torch: {INSTALL}")


def require_torch(what: str) -> Any:
    """The torch module, imported with Ctrl-C held back until the import is done (see
    :mod:`mdiedge.base.interrupts`), computing with the threads ``threads.use_threads``
    chose; ``TorchMissing`` naming ``what`` where it is not installed."""
    with interrupts.held():
        try:
            import torch
        except ImportError:
            raise torch_missing(what) from None
    threads.torch_follows()
    return torch


def torch_loaded() -> Optional[Any]:
    """torch where this process imported it already, else None (never imports it)."""
    import sys

    return sys.modules.get("torch")
