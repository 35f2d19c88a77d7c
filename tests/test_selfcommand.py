"""A local ring's workers run the starter's own package, whatever the working directory: from
a clone's root, ``python -m mdiedge`` would import the source tree (its pure-Python twins)
instead. Each node's status says which package and which implementations it runs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mdiedge.base.accel import running_code
from mdiedge.base.selfcommand import mdiedge_command, package_root

PACKAGE = Path(__file__).resolve().parent.parent / "mdiedge"


@pytest.fixture
def in_a_source_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory is a copy of the source tree, without compiled modules, as a
    clone's root is: whatever ``python -m`` starts there imports that copy."""
    tree = tmp_path / "clone"
    shutil.copytree(PACKAGE, tree / "mdiedge",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(PACKAGE.parent / "models", tree / "models")
    monkeypatch.chdir(tree)
    return tree


def test_the_command_is_mdiedge_in_usage_lines(in_a_source_tree: Path) -> None:
    out = subprocess.run(mdiedge_command(["worker", "--help"]), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "mdiedge worker" in out.stdout


def test_local_ring_workers_report_the_starters_code(in_a_source_tree: Path) -> None:
    from mdiedge.engine.opening import EngineSpec, open_engine
    from mdiedge.model.sampling import SamplingParams

    plain = subprocess.run([sys.executable, "-c", "import mdiedge; print(mdiedge.__file__)"],
                           capture_output=True, text=True)
    assert plain.stdout.startswith(str(in_a_source_tree))  # what -m would import here
    with open_engine(EngineSpec(nodes=3, threads=1)) as engine:
        engine.generate("ROMEO:", max_new_tokens=2, params=SamplingParams(0.0))
        statuses = engine.status()
    ours = running_code()
    assert len(statuses) == 3
    for status in statuses:
        assert status.code["package"] == package_root() != str(in_a_source_tree), status.name
        for module in ("step", "quant", "framing"):  # a torch-free node never needs matvec
            assert status.code["modules"][module] == ours["modules"][module], status.name
        assert status.threads == 1, status.name


@pytest.mark.skipif(os.environ.get("MDIEDGE_NO_EXTENSIONS", "") not in ("", "0"),
                    reason="the twins are forced")
def test_a_missing_compiled_module_is_one_warning(in_a_source_tree: Path) -> None:
    """The copy in the working directory has no compiled modules: a node run from it says so
    once, naming the package it imported."""
    out = subprocess.run([sys.executable, "-m", "mdiedge", "generate", "ROMEO:", "-n", "2",
                          "--nodes", "1", "--temperature", "0"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "compiled modules missing" in line]
    assert len(warnings) == 1, out.stderr
    assert str(in_a_source_tree) in warnings[0]
