"""Ring files: the starter's settings and the already-running workers it drives.

A ring file is a settings file (see :mod:`mdiedge.base.settings`, which validates it) with at
least one ``[[workers]]`` entry; ``[starter]`` is optional, and a ``[worker]`` table, if any,
is ignored here::

    [starter]                 # all keys optional
    host = "10.0.0.1"         # address the last worker connects back to
    device = "cpu"
    weight = 1.0
    memory = "4GiB"
    layers = [0, 2]
    max_payload = "64MiB"
    prefill_chunk = 128       # prompt tokens per prefill message (0: the whole prompt)
    timeout_s = 60
    stall_s = 3               # a node silent this long is lost; the ring recovers without it
    recover = true
    rebalance_margin = 0.25   # re-split when the slowest node is this far above the mean
    compression = "int8"      # codecs of every link whose worker names none (--compression wins)
    quantize = "q8_0"         # the blocks' float weights quantized on load (--quantize wins)

    [[workers]]
    name = "w1"
    host = "10.0.0.2"
    control_port = 7700
    device = "cuda"
    weight = 2.0
    memory = "6GiB"
    layers = [2, 7]
    spare = false             # true: held back to replace a lost node
    compression = "fp16"      # codecs of the link into this worker

With ``secret=True`` the options carry the ring secret too (``secret``/``secret_file`` in
``[starter]``, else the environment), so a starter can talk to secured workers.

The workers come back as :class:`~mdiedge.base.nodes.NodeSpec` records; no torch is needed.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Tuple, Union

from .errors import ConfigError
from .nodes import NodeSpec
from .settings import StarterSettings, load_settings, parse_bytes, read_secret

__all__ = ["load_ring", "parse_bytes", "starter_options"]


def load_ring(path: Union[str, "os.PathLike[str]"], secret: bool = False,
              env: Mapping[str, str] = os.environ) -> Tuple[Dict[str, Any], List[NodeSpec]]:
    """The starter's options (fields of ``StarterOptions``, the ``RingEngine`` keywords: host,
    device, weight, memory, layers, max_payload, prefill_chunk, timeout_s, stall_s, recover,
    rebalance_margin, compression, quantize, busy_poll_us, encrypt; with ``secret``, also
    ``secret``: the ``[starter]`` table's secret or secret_file, else
    ``$MDIEDGE_SECRET(_FILE)`` in ``env``, else None) and the workers of a ring file, in ring order; errors name the file and key."""
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
    """The ``StarterOptions`` fields a ``[starter]`` table sets, the one route from a ring
    file or a starter's config into them (its dtype aside: a ring file's is the command
    line's)."""
    return {key: getattr(starter, key) for key in STARTER_KEYS}
