"""Ring files: a settings file (``mdiedge.base.settings`` validates it) with at least one
``[[workers]]`` entry, for a starter that drives already-running workers; ``[starter]`` is optional
and ``[worker]`` ignored here. README.md lists the keys. No torch."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Tuple, Union

from .errors import ConfigError
from .nodes import NodeSpec
from .settings import StarterSettings, load_settings, parse_bytes, read_secret

__all__ = ["load_ring", "parse_bytes", "starter_options"]


def load_ring(path: Union[str, "os.PathLike[str]"], secret: bool = False,
              env: Mapping[str, str] = os.environ) -> Tuple[Dict[str, Any], List[NodeSpec]]:
    """The starter's options (``StarterOptions`` fields) and the workers (``NodeSpec``s, in ring
    order) of a ring file; with ``secret`` also ``secret``: ``[starter]``'s secret or secret_file,
    else ``$MDIEDGE_SECRET(_FILE)`` in ``env``, else None. Errors name the file and key."""
    settings = load_settings(path)
    if not settings.workers:
        raise ConfigError(f"{settings.source}: workers: a ring file needs at least one "
                          f"[[workers]] entry, got none")
    options = starter_options(settings.starter or StarterSettings())
    if secret:
        options["secret"] = read_secret(settings.starter, env)
    return options, list(settings.workers)


STARTER_KEYS = ("host", "device", "weight", "memory", "layers", "max_payload", "prefill_chunk",
                "timeout_s", "stall_s", "recover", "rebalance_margin", "compression",
                "quantize", "busy_poll_us", "encrypt")


def starter_options(starter: StarterSettings) -> Dict[str, Any]:
    """The ``StarterOptions`` fields a ``[starter]`` table sets: the one route from a ring file or
    a starter's config into them (not the dtype: a ring file's is the command line's)."""
    return {key: getattr(starter, key) for key in STARTER_KEYS}
