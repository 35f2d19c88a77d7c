"""Ring files: the starter's settings and the already-running workers it drives.

A ring file is a settings file (see :mod:`mdiedge.settings`, which validates it) with at
least one ``[[workers]]`` entry; ``[starter]`` is optional, and a ``[worker]`` table, if any,
is ignored here::

    [starter]                 # all keys optional
    host = "10.0.0.1"         # address the last worker connects back to
    device = "cpu"
    weight = 1.0
    memory = "4GiB"
    layers = [0, 2]
    max_payload = "64MiB"
    timeout_s = 60

    [[workers]]
    name = "w1"
    host = "10.0.0.2"
    control_port = 7700
    device = "cuda"
    weight = 2.0
    memory = "6GiB"
    layers = [2, 7]

torch is imported only when :func:`load_ring` builds the worker addresses.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Union

from .errors import ConfigError
from .settings import StarterSettings, load_settings, parse_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..roles.starter import WorkerAddress

__all__ = ["load_ring", "parse_bytes"]


def load_ring(path: Union[str, "os.PathLike[str]"]
              ) -> Tuple[Dict[str, Any], List["WorkerAddress"]]:
    """``RingEngine`` keyword options (host, device, starter_weight, starter_memory,
    starter_layers; max_payload and timeout_s only when the file sets them) and the workers
    of a ring file; errors name the file and key."""
    from ..roles.starter import WorkerAddress

    settings = load_settings(path)
    if not settings.workers:
        raise ConfigError(f"{settings.source}: workers: a ring file needs at least one "
                          f"[[workers]] entry, got none")
    starter = settings.starter if settings.starter is not None else StarterSettings()
    options: Dict[str, Any] = {
        "host": starter.host, "device": starter.device, "starter_weight": starter.weight,
        "starter_memory": starter.memory, "starter_layers": starter.layers,
    }
    if starter.max_payload is not None:
        options["max_payload"] = starter.max_payload
    if "timeout_s" in starter.keys_set:
        options["timeout_s"] = starter.timeout_s
    workers = [WorkerAddress(name=w.name, host=w.host, control_port=w.control_port,
                             weight=w.weight, memory=w.memory, layers=w.layers, device=w.device)
               for w in settings.workers]
    return options, workers
