"""Models by name, from the local Hugging Face cache and never from the network: a repo id
(``TinyLlama/TinyLlama-1.1B-Chat-v1.0``) or a cache folder (``models--Org--Name``) is the
snapshot that ``refs/main`` names, else the newest one.

The cache is where ``huggingface_hub`` keeps it: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``, read at each call. Repo ids go through ``huggingface_hub``
(``snapshot_download`` with ``local_files_only``), an optional dependency imported only here
and only for a repo id; cache folders need nothing but the file system.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Mapping, Optional

from ..base.errors import CheckpointError

__all__ = ["hub_cache_dir", "looks_like_repo_id", "is_cache_folder", "cache_folder_snapshot",
           "resolve_name", "download_command"]

CACHE_PREFIX = "models--"
# a namespace or a name as the Hub allows them: letters, digits, "-", "_", "."; neither
# starts or ends with "-" or ".", and none holds "--" or ".."
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


def _parts_ok(parts: List[str]) -> bool:
    return len(parts) == 2 and all(_PART.fullmatch(p) and "--" not in p and ".." not in p
                                   for p in parts)


def _cache_name_repo(name: str) -> Optional[str]:
    """``Org/Name`` of a cache folder name ``models--Org--Name``, else None."""
    parts = name[len(CACHE_PREFIX):].split("--") if name.startswith(CACHE_PREFIX) else []
    return "/".join(parts) if _parts_ok(parts) else None


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face hub cache that ``env`` selects, as ``huggingface_hub`` finds it."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                              "huggingface")
    return Path(home).expanduser() / "hub"


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` has the shape of a Hub model id ``namespace/name``."""
    return _parts_ok(name.split("/"))


def is_cache_folder(path: Path) -> bool:
    """Whether ``path`` is a model's folder of a Hugging Face cache (``models--Org--Name``,
    holding ``refs/`` and ``snapshots/``) rather than a model directory itself."""
    return path.is_dir() and path.name.startswith(CACHE_PREFIX) \
        and not (path / "config.json").exists()


def download_command(repo_id: str, hub_version: Optional[str]) -> str:
    """The command that puts ``repo_id`` in the cache, for the installed ``huggingface_hub``
    (``hf`` from 1.0 on, ``huggingface-cli`` before; ``hf`` once it is installed)."""
    major = (hub_version or "1").split(".", 1)[0]
    cli = "huggingface-cli" if major.isdigit() and int(major) < 1 else "hf"
    return f"{cli} download {repo_id}"


def _repo_of(folder: Path) -> str:
    return _cache_name_repo(folder.name) or "ORG/NAME"


def cache_folder_snapshot(folder: Path) -> Path:
    """The snapshot of a ``models--Org--Name`` folder: the one ``refs/main`` names, else the
    newest; CheckpointError naming the folder when it holds none."""
    snapshots = folder / "snapshots"
    ref = folder / "refs" / "main"
    if ref.is_file():
        named = snapshots / ref.read_text().strip()
        if named.is_dir():
            return named
    found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    if not found:
        raise CheckpointError(f"{folder}: a Hugging Face cache folder without a snapshot "
                              f"(nothing in {snapshots}); download the model again: "
                              f"{download_command(_repo_of(folder), None)}")
    return max(found, key=lambda p: (p.stat().st_mtime, p.name))


def resolve_name(name: str, env: Mapping[str, str] = os.environ) -> Optional[Path]:
    """The local snapshot of ``name``, a path that does not exist: a ``models--Org--Name``
    folder of the cache, or a repo id. None when ``name`` is neither; CheckpointError naming
    what to download (or install) when it is one but is not in the cache."""
    cache = hub_cache_dir(env)
    if _cache_name_repo(name) and (cache / name).is_dir():
        return cache_folder_snapshot(cache / name)
    if not looks_like_repo_id(name):
        return None
    try:
        import huggingface_hub
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{name}: no such file or directory; to load a Hugging Face repo "
                              f"id from the local cache install huggingface_hub (pip install "
                              f"huggingface_hub), then: hf download {name}") from None
    try:
        return Path(snapshot_download(name, cache_dir=str(cache), local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or a bad id
        folder = cache / (CACHE_PREFIX + name.replace("/", "--"))
        if folder.is_dir() and any((folder / "snapshots").glob("*/")):
            return cache_folder_snapshot(folder)  # cached at a revision other than main
    raise CheckpointError(f"{name}: no such file or directory, nor a model in the local Hugging "
                          f"Face cache {cache}; download it first: "
                          f"{download_command(name, huggingface_hub.__version__)}")
