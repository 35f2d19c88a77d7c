"""The held-out text the quality commands read by default ships with the package: the
README's commands name no file a clone lacks, and `mdiedge calibrate-exit` runs without
--text from a directory with nothing beside it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from mdiedge.base import defaults
from commands import MDIEDGE

REPO = Path(__file__).resolve().parents[1]


def test_the_readmes_name_no_workspace_files() -> None:
    """``../shared`` exists on the developers' machine, not in a user's clone."""
    for readme in (REPO / "README.md", REPO / "models" / "nanollama" / "README.md"):
        assert "../shared" not in readme.read_text(encoding="utf-8"), readme


def test_the_default_text_is_the_shipped_held_out_split() -> None:
    path, share = defaults.held_out_text(None)
    assert path.name == defaults.HELD_OUT_TEXT and path.is_file() and share == 1.0
    assert 50_000 < path.stat().st_size < 128_000
    assert path.read_text(encoding="utf-8").startswith("\n\nGREMIO:\nGood morrow, neighbour")
    assert defaults.held_out_text("some.txt") == (Path("some.txt"), defaults.HELD_OUT_SHARE)
    corpus = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"  # where a workspace has it
    if corpus.is_file():
        raw = corpus.read_text(encoding="utf-8")
        assert path.read_text(encoding="utf-8") == raw[int(len(raw) * (1 - defaults.HELD_OUT_SHARE)):]


def test_calibrate_exit_without_text(tmp_path: Path) -> None:
    """From an empty directory: the thresholds and the classifier (trained on the held-out
    tokens the calibration does not read), written beside a copy of the shipped model."""
    model = tmp_path / "model"
    shutil.copytree(defaults.default_model_path(), model)
    (model / "early_exit.json").unlink()
    work = tmp_path / "empty"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([*MDIEDGE, "calibrate-exit", "--model",
                           str(model), "--criterion", "classifier", "--criterion", "similarity",
                           "--tokens", "600", "--train-tokens", "300", "--json"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)["criteria"]) == ["classifier", "similarity"]
    written = json.loads((model / "early_exit.json").read_text())["calibrated_on"]
    assert written["text"] == defaults.HELD_OUT_TEXT and written["held_out"] == 1.0
    assert written["classifier_train_tokens"] == 300
