"""``mdiedge generate --nodes N`` with more workers than the model has blocks fails at once,
on one line naming the blocks and the nodes, before any worker process is started."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, List

import pytest
from typer.testing import CliRunner

from mdiedge.cli import app


def test_too_many_nodes_fail_before_any_worker_starts(stories: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    started: List[Any] = []

    def no_process(*args: Any, **kwargs: Any) -> None:
        started.append(args)
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    t0 = time.monotonic()
    result = CliRunner().invoke(app, [
        "generate", "Once", "--model", str(stories / "stories260K.bin"), "--tokenizer",
        str(stories / "tok512.model"), "--nodes", "20", "-n", "4"])
    elapsed = time.monotonic() - t0
    assert started == []
    assert result.exit_code != 0
    output = result.output.strip()
    assert "Traceback" not in output and len(output.splitlines()) == 1, output
    assert output.startswith("mdiedge: error: 5 blocks cannot be shared among 19 workers "
                             "(a ring of 20 nodes)"), output
    assert "at most 6 nodes" in output
    assert elapsed < 5, elapsed
