"""Memory of this process as status and benchmarks report it (Linux ``/proc``, else rusage)."""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any


def rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return max_rss_bytes()


def max_rss_bytes() -> int:
    """Peak resident memory of this process image: ``VmHWM`` on Linux, because ``ru_maxrss``
    carries over the peak of the parent that forked this process across ``exec``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def available_bytes() -> "int | None":
    """Memory this process may still take: ``MemAvailable`` (Linux), within the room left under its
    cgroup's ``memory.max`` (a systemd ``MemoryMax=``, a container); None when neither is known."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _cgroup_room() -> "int | None":
    """``memory.max`` less ``memory.current`` of this process's cgroup (v2), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            line = next((x for x in f if x.startswith("0::")), None)
        if line is None:
            return None
        folder = "/sys/fs/cgroup" + line.strip()[3:]
        with open(folder + "/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(folder + "/memory.current") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


ARENA_MAX_ENV = "MALLOC_ARENA_MAX"  # glibc's own setting, which a user's value keeps
M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def one_malloc_arena() -> bool:
    """One C heap for every thread (glibc's ``mallopt(M_ARENA_MAX, 1)``) unless
    ``$MALLOC_ARENA_MAX`` says otherwise: each thread that allocates (numpy's arrays on the
    prefill's attention threads, the server's) would otherwise get an arena of its own whose
    freed pages stay resident (2.5 MiB of a SmolLM2 node's peak at 2 threads). Allocations are
    made holding the GIL, so one arena costs no waiting. False where not applied."""
    if ARENA_MAX_ENV in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, 1))


def give_back_free_memory() -> bool:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``: after a burst,
    freed buffers stay resident otherwise); False where the C library has no such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def zeroed_pages(nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeros, anonymous memory resident only where written, a 4 KiB page at a
    time: numpy's own allocations past 4 MiB ask for 2 MiB huge pages, which made a sparse KV
    cache resident 2 MiB per slot and head at its first token (8 slots x 4096 tokens of
    Gemma 3: 520 MB for 12 tokens a slot)."""
    pages = mmap.mmap(-1, max(1, nbytes))
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None and hasattr(pages, "madvise"):
        pages.madvise(advice)
    return pages


def drop_mapped_pages(mapped: Any, view: Any) -> bool:
    """Let the kernel drop the pages of ``view`` (a numpy view of the memory-mapped file
    ``mapped``, a numpy ``memmap``) from this process's resident memory: bytes read once and
    copied (a GGUF file's Q/K rows, gathered) stay mapped, read again from the file if ever
    touched. Only whole pages inside the view; False where the map or the system cannot."""
    handle = getattr(mapped, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if handle is None or advice is None or not hasattr(handle, "madvise"):
        return False
    skipped = int(getattr(mapped, "offset", 0)) % mmap.ALLOCATIONGRANULARITY
    base = mapped.__array_interface__["data"][0] - skipped  # the map's first byte
    start = view.__array_interface__["data"][0] - base
    end = start + view.nbytes
    if not skipped <= start <= end <= skipped + mapped.nbytes:
        return False
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        handle.madvise(advice, first, last - first)
    return True
