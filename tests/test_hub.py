"""Models by name: a Hugging Face repo id or a ``models--Org--Name`` folder resolves to its
snapshot in the local cache (``$HF_HUB_CACHE``), offline; what is not there is one line
naming what to download. A path that exists is a path."""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
from typer.testing import CliRunner

from mdiedge.base.errors import CheckpointError
from mdiedge.model import hub
from mdiedge.model.checkpoint import load_config, resolve_model_path

REPO = "Org/Tiny-Llama_1.1B"
FOLDER = "models--Org--Tiny-Llama_1.1B"


def snapshot(cache: Path, folder: str, commit: str, model: Path, mtime: float) -> Path:
    """A snapshot as the hub writes one: links to blobs (here, to the model's files)."""
    path = cache / folder / "snapshots" / commit
    path.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file():
            (path / f.name).symlink_to(f)
    os.utime(path, (mtime, mtime))
    return path


@pytest.fixture
def cache(tmp_path: Path, ring_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding REPO at two commits, ``refs/main`` naming the older one."""
    root = tmp_path / "hub"
    snapshot(root, FOLDER, "c0ffee", ring_model, 1_000_000)
    snapshot(root, FOLDER, "beef42", ring_model, 2_000_000)
    (root / FOLDER / "refs").mkdir()
    (root / FOLDER / "refs" / "main").write_text("c0ffee")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


@pytest.mark.parametrize("name, ok", [
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", True), ("Org/Name", True), ("a/b", True),
    ("gpt2", False), ("/abs/path", False), ("./Org/Name", False), ("Org/Name/x", False),
    ("Org//Name", False), ("Org/-Name", False), ("Org/Name.", False), ("Org/Na--me", False),
    ("Org/Na..me", False), ("~/models", False), ("models/x.bin", True), ("", False)])
def test_looks_like_repo_id(name: str, ok: bool) -> None:
    assert hub.looks_like_repo_id(name) is ok


@pytest.mark.parametrize("env, expected", [
    ({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}, "/c/hub"),
    ({"HUGGINGFACE_HUB_CACHE": "/old/hub"}, "/old/hub"),
    ({"HF_HOME": "/h"}, "/h/hub"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
    ({"HOME": "/home/u"}, "~/.cache/huggingface/hub"),
])
def test_hub_cache_dir(env: Dict[str, str], expected: str) -> None:
    assert hub.hub_cache_dir(env) == Path(expected).expanduser()


@pytest.mark.parametrize("version, command", [
    ("0.36.0", "huggingface-cli download Org/Name"), ("1.0.0", "hf download Org/Name"),
    ("2.4.0", "hf download Org/Name"), (None, "hf download Org/Name")])
def test_download_command(version: Any, command: str) -> None:
    assert hub.download_command("Org/Name", version) == command


def test_repo_id_resolves_to_the_snapshot_refs_main_names(cache: Path) -> None:
    path = resolve_model_path(REPO)
    assert path == cache / FOLDER / "snapshots" / "c0ffee"
    assert load_config(REPO).n_layers == 6


def test_cache_folder_resolves_through_refs_main(cache: Path) -> None:
    assert resolve_model_path(cache / FOLDER) == cache / FOLDER / "snapshots" / "c0ffee"
    assert resolve_model_path(FOLDER) == cache / FOLDER / "snapshots" / "c0ffee"  # by name


def test_without_refs_main_the_newest_snapshot(cache: Path) -> None:
    (cache / FOLDER / "refs" / "main").unlink()
    assert resolve_model_path(cache / FOLDER) == cache / FOLDER / "snapshots" / "beef42"
    assert resolve_model_path(REPO) == cache / FOLDER / "snapshots" / "beef42"


def test_cache_folder_without_a_snapshot(tmp_path: Path) -> None:
    folder = tmp_path / "models--Org--Gone"
    (folder / "refs").mkdir(parents=True)
    with pytest.raises(CheckpointError) as raised:
        resolve_model_path(folder)
    assert str(raised.value) == (f"{folder}: a Hugging Face cache folder without a snapshot "
                                 f"(nothing in {folder / 'snapshots'}); download the model "
                                 f"again: hf download Org/Gone")


def test_missing_repo_id_names_what_to_download(cache: Path) -> None:
    with pytest.raises(CheckpointError) as raised:
        resolve_model_path("Org/Missing")
    assert str(raised.value) == (f"Org/Missing: no such file or directory, nor a model in the "
                                 f"local Hugging Face cache {cache}; download it first: "
                                 f"hf download Org/Missing")


def test_a_path_that_exists_wins_over_the_cache(cache: Path, tmp_path: Path, ring_model: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "work" / "Org" / "Tiny-Llama_1.1B"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path(REPO) == Path(REPO)


def test_resolution_never_touches_the_network(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    assert resolve_model_path(REPO).name == "c0ffee"
    with pytest.raises(CheckpointError, match="hf download Org/Missing$"):
        resolve_model_path("Org/Missing")


def test_without_huggingface_hub_the_error_says_to_install_it(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(CheckpointError) as raised:
        resolve_model_path(REPO)
    assert str(raised.value) == (f"{REPO}: no such file or directory; to load a Hugging Face "
                                 f"repo id from the local cache install huggingface_hub (pip "
                                 f"install huggingface_hub), then: hf download {REPO}")
    assert resolve_model_path(cache / FOLDER).name == "c0ffee"  # a folder needs no hub


def test_generate_by_repo_id(cache: Path) -> None:
    from mdiedge.cli import app

    result = CliRunner().invoke(app, ["generate", "hello", "--model", REPO, "-n", "3",
                                      "--nodes", "1", "--json", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["model"] == str(cache / FOLDER / "snapshots" / "c0ffee")
    assert len(out["samples"][0]["token_ids"]) == 3


def test_generate_names_what_to_download(cache: Path) -> None:
    from mdiedge.cli import app

    result = CliRunner().invoke(app, ["generate", "hello", "--model", "Org/Missing"])
    assert result.exit_code != 0
    assert result.output.strip() == (f"mdiedge: error: Org/Missing: no such file or directory, "
                                     f"nor a model in the local Hugging Face cache {cache}; "
                                     f"download it first: hf download Org/Missing")
