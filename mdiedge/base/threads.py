"""How many threads a node computes with, and how its idle threads wait.

``--threads`` 0 gives each node of this machine its share of the cores this process may use
(affinity, a cgroup's ``cpu.max``): all for one node, ``cores // nodes`` for a local ring, at least
one.

OpenMP threads spin between parallel regions before sleeping (libgomp: 300,000 rounds), and a decode
step has six barriers per block. On a shared machine spinning holds a core the awaited thread needs
(SmolLM2 fell from 135 to 1.8 tok/s beside two busy loops); sleeping at once costs a wake-up per
barrier (115 to 74 tok/s on a quiet 2-core VM). So ``openmp_waits`` looks once at how many other
tasks run: passive waits where they take half the cores or more, else a short spin; a user's policy
wins. It must run before an OpenMP runtime loads, so ``python -m mdiedge`` calls
``choose_openmp_waits`` first; local-ring workers inherit it."""
from __future__ import annotations

import math
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Mapping, Optional

from . import defaults

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
NUM_THREADS = "OMP_NUM_THREADS"
BLAS_THREADS = "OPENBLAS_NUM_THREADS"
SPIN_BEFORE_SLEEP = 3000  # libgomp's rounds of spinning before a wait sleeps, on a quiet machine
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
PROC_STAT = "/proc/stat"


def openmp_waits(environ: Mapping[str, str], others_running: int, cores: int) -> Dict[str, str]:
    """The OpenMP settings to add to ``environ``; none where the user set a policy or spin count."""
    if WAIT_POLICY in environ or SPIN_COUNT in environ:
        return {}
    if others_running * 2 >= cores:
        return {WAIT_POLICY: "PASSIVE"}
    return {SPIN_COUNT: str(SPIN_BEFORE_SLEEP)}


def others_running() -> int:
    """Median of a few ``procs_running`` readings, less this process; 0 where unreadable."""
    readings = []
    for i in range(defaults.LOAD_SAMPLES):
        text = _read(PROC_STAT, 1 << 16) or ""
        found = re.search(r"^procs_running (\d+)$", text, re.M)
        if found is None:
            return 0
        readings.append(int(found.group(1)) - 1)
        if i + 1 < defaults.LOAD_SAMPLES:
            time.sleep(defaults.LOAD_SAMPLE_GAP_S)
    return max(0, int(statistics.median(readings)))


def choose_openmp_waits() -> None:
    """Into the environment (children inherit it); nothing where the user chose a policy."""
    if WAIT_POLICY in os.environ or SPIN_COUNT in os.environ:
        return
    # procs_running counts the whole machine's tasks: weigh them against all its cores
    os.environ.update(openmp_waits(os.environ, others_running(), os.cpu_count() or 1))


def blas_thread_setting(environ: Mapping[str, str]) -> Dict[str, str]:
    """What to add to ``environ`` so that numpy's OpenBLAS starts no threads of its own: the
    torch-free prefill calls it with one (``mdiedge.model.blasthreads``), and the threads it
    would start at numpy's import poll for work for a while (2-3% of a short two-thread
    decode on 2 cores). Nothing where the user set a count."""
    return {} if BLAS_THREADS in environ else {BLAS_THREADS: "1"}


def choose_blas_threads() -> None:
    """Into the environment before numpy loads (children inherit it)."""
    os.environ.update(blas_thread_setting(os.environ))


def openmp_wait_mode() -> str:
    """``passive``, ``spin N`` (rounds), or ``libgomp default``."""
    policy = os.environ.get(WAIT_POLICY, "").strip().lower()
    if SPIN_COUNT in os.environ:
        return f"spin {os.environ[SPIN_COUNT]}"
    return policy or "libgomp default"


def cgroup_cores(text: Optional[str]) -> Optional[int]:
    """Quota over period, rounded up; None when no limit or unreadable."""
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


def _read(path: str, limit: int = 200) -> Optional[str]:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(limit)
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """CPU affinity, within the cgroup's quota."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cores(_read(CGROUP_CPU_MAX))
    return max(1, min(cores, quota) if quota is not None else cores)


def node_threads(requested: int, nodes_here: int, cores: int,
                 environ: Mapping[str, str] = os.environ) -> int:
    """``requested`` when > 0, else ``OMP_NUM_THREADS`` when it sets a number >= 1 (torch and
    llama.cpp users' habit), else an equal share of ``cores``, at least one."""
    if requested > 0:
        return requested
    told = environ.get(NUM_THREADS, "").strip()
    if told.isdigit() and int(told) >= 1:
        return int(told)
    return max(1, cores // max(1, nodes_here))


_chosen: List[int] = []  # the threads this process was told to compute with (use_threads)


def use_threads(threads: int) -> None:
    """The compiled kernels' count (``compute_threads``) and torch's where loaded (never imported
    here)."""
    _chosen[:] = [threads]
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def torch_follows() -> None:
    if _chosen:
        use_threads(_chosen[0])


def compute_threads() -> int:
    """``use_threads``'s count, else torch's where loaded, else 0 (not chosen yet)."""
    if _chosen:
        return _chosen[0]
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 0


def kernel_threads() -> int:
    """``compute_threads``, or unchosen, this process's share as a lone node."""
    return compute_threads() or node_threads(0, 1, available_cores())
