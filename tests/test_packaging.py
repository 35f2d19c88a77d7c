"""What an install carries: every package under mdiedge/ is listed in setup.cfg, so that a
wheel or a non-editable install does not silently leave a subpackage out."""
from __future__ import annotations

import configparser
from pathlib import Path
from typing import Set

REPO = Path(__file__).resolve().parent.parent


def _listed() -> Set[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return {line.strip() for line in config["options"]["packages"].splitlines() if line.strip()}


def _on_disk() -> Set[str]:
    root = REPO / "mdiedge"
    return {".".join(init.parent.relative_to(REPO).parts) for init in root.rglob("__init__.py")
            if "__pycache__" not in init.parts}


def test_every_package_is_installed() -> None:
    missing = sorted(_on_disk() - _listed())
    assert not missing, f"setup.cfg [options] packages lacks {missing}"


def test_setup_cfg_lists_no_package_that_is_gone() -> None:
    listed = {name for name in _listed() if not name.startswith("mdiedge._")}  # package_dir maps
    gone = sorted(listed - _on_disk())
    assert not gone, f"setup.cfg lists packages with no __init__.py: {gone}"


def _requirements(section: str, key: str) -> Set[str]:
    """The distribution names a setup.cfg list of requirements holds."""
    import re

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return {re.split(r"[<>=;! ]", line.strip(), 1)[0] for line in config[section][key].splitlines()
            if line.strip()}


def test_torch_is_an_extra_not_a_requirement() -> None:
    """A CPU node installs and runs without torch (README, What needs torch); the extra
    ``torch`` brings it, and the test extra too (the tests compare with the torch path)."""
    assert "torch" not in _requirements("options", "install_requires")
    assert "torch" in _requirements("options.extras_require", "torch")
    assert "torch" in _requirements("options.extras_require", "test")
    build = (REPO / "pyproject.toml").read_text()
    assert "torch" not in build.split("[build-system]", 1)[1].split("\n[", 1)[0]
