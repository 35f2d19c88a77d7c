"""``[starter] compression`` of a ring file or starter config: the codecs of every link whose
worker names none, unless ``--compression`` is given on the command line (an explicit flag
wins, even ``none``; an absent one keeps the file's)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import pytest

from mdiedge.base.settings import load_settings
from mdiedge.base.engineoptions import EngineOptions, canonical_compression
from mdiedge.cli.app import engine_spec
from mdiedge.engine.opening import open_engine
from mdiedge.cli.nodes import _starter_engine

from conftest import FakeEngine


def ring_file(tmp_path: Path, compression: Optional[str]) -> Path:
    line = f'compression = "{compression}"\n' if compression else ""
    path = tmp_path / "ring.toml"
    path.write_text(f'[starter]\n{line}[[workers]]\nhost = "127.0.0.1"\ncontrol_port = 7700\n')
    return path


def test_an_absent_flag_is_no_change() -> None:
    assert "compression" not in EngineOptions(recover=True).checked().given_ring_options()
    given = EngineOptions(recover=True, compression="none").checked().given_ring_options()
    assert given["compression"] == "none"
    assert canonical_compression(None) is None
    assert canonical_compression("int8:fp16") == "int8:fp16"


@pytest.mark.parametrize("in_file,flag,want", [
    ("int8", None, "int8"),        # the file's holds
    ("int8", "fp16", "fp16"),      # an explicit flag wins
    ("int8", "none", "none"),      # even the default's value, given explicitly
    (None, None, "none"),          # neither: none
    (None, "int8:fp16", "int8:fp16"),
])
def test_generate_ring_merges_the_file_and_the_flag(tmp_path: Path, ring_model: Path,
                                                    fake_engine: List[FakeEngine],
                                                    in_file: Optional[str], flag: Optional[str],
                                                    want: str) -> None:
    open_engine(engine_spec(EngineOptions(model=str(ring_model), nodes=1, recover=True,
                                          compression=flag,
                                          ring=str(ring_file(tmp_path, in_file))).checked()))
    assert fake_engine[0].options.compression == want


@pytest.mark.parametrize("in_file,flag,want", [("int8", None, "int8"), ("int8", "fp16", "fp16"),
                                               (None, None, "none")])
def test_the_starter_merges_its_config_and_the_flag(tmp_path: Path,
                                                    fake_engine: List[FakeEngine],
                                                    in_file: Optional[str], flag: Optional[str],
                                                    want: str) -> None:
    settings = load_settings(ring_file(tmp_path, in_file))
    _starter_engine(settings, settings.starter, EngineOptions(compression=flag).checked(), None,
                    "http://127.0.0.1:1")
    assert fake_engine[0].options.compression == want


def test_local_rings_keep_the_default_without_a_flag(ring_model: Path,
                                                     fake_engine: List[FakeEngine],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import mdiedge.roles.local_ring as local_ring

    class NoRing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.secret = b"x" * 32

        def __enter__(self) -> List[Any]:
            return []

        def __exit__(self, *exc: Any) -> None:
            pass

    import torch

    monkeypatch.setattr(local_ring, "LocalRing", NoRing)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave this process's alone
    for flag in (None, "int8"):
        open_engine(engine_spec(EngineOptions(model=str(ring_model), nodes=2, recover=True,
                                              compression=flag).checked()))
    assert fake_engine[0].options.compression == "none"
    assert fake_engine[1].options.compression == "int8"
