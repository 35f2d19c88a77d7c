"""A node's device as torch spells it, without torch for the CPU (a CPU node runs without
it); another device needs torch, a one-line error where it is not installed."""
from __future__ import annotations

from ..base.torchcheck import require_torch


def device_of(name: str, what: str = "--device") -> str:
    """``name`` checked and spelled as torch does (``cuda`` -> ``cuda:0``); ``cpu`` as it is."""
    if name == "cpu":
        return name
    require_torch(f"{what} {name}")
    from ..model.devices import parse_device

    return str(parse_device(name))
