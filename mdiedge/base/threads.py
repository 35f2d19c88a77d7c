"""How many threads a node computes with, and how its idle threads wait.

A node's compute threads are torch's thread count, which the compiled kernels take too
(OpenMP). ``--threads N`` (and the ``threads`` config key) sets it; 0 gives each node of this
machine its share of the cores this process may use (its CPU affinity, within a cgroup's
``cpu.max``): all of them for one node, ``cores // nodes`` for a local ring, at least one.

OpenMP's threads spin by default between parallel regions. On a machine others share, a
spinning thread holds a core while the thread its team waits for is not running, and a decode
step (six barriers per block) collapses: SmolLM2 fell from 135 to 1.8 tok/s beside two busy
loops. ``prefer_passive_waits`` makes them sleep instead unless the user chose otherwise; it
must run before an OpenMP runtime loads (torch's or the kernels'), so ``python -m mdiedge``
calls it first.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Optional

WAIT_POLICY = "OMP_WAIT_POLICY"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def prefer_passive_waits() -> None:
    """Idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the environment sets a
    policy already; child processes inherit it."""
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def cgroup_cores(text: Optional[str]) -> Optional[int]:
    """The cores a cgroup's ``cpu.max`` text allows (its quota over its period, rounded up),
    or None when it sets no limit or cannot be read."""
    if not text:
        return None
    words = text.split()
    if len(words) != 2 or words[0] == "max":
        return None
    try:
        quota, period = int(words[0]), int(words[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(200)
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, within its cgroup's quota."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cores(_read(CGROUP_CPU_MAX))
    return max(1, min(cores, quota) if quota is not None else cores)


def node_threads(requested: int, nodes_here: int, cores: int) -> int:
    """The threads of one of ``nodes_here`` nodes sharing ``cores``: ``requested`` when it is
    set (> 0), else an equal share of the cores, at least one."""
    if requested > 0:
        return requested
    return max(1, cores // max(1, nodes_here))


def compute_threads() -> int:
    """The threads this process computes with (torch's count, which the kernels take), or
    0 before torch is loaded."""
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 0
