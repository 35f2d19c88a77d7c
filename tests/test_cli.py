"""The command line as a user runs it: real subprocesses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest


def mdiedge(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mdiedge", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_does_not_import_torch() -> None:
    code = "import sys, mdiedge.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    out = mdiedge("--help")
    assert out.returncode == 0 and "generate" in out.stdout


def stories_args(stories: Path) -> List[str]:
    return ["--model", str(stories / "stories260K.bin"), "--tokenizer", str(stories / "tok512.model")]


def test_generate_json(stories: Path) -> None:
    out = mdiedge("generate", "", "-n", "20", "--temperature", "0", "--json", *stories_args(stories))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    sample = result["samples"][0]
    assert sample["text"].startswith("Once upon a time")
    assert len(sample["token_ids"]) == 20 and sample["finish_reason"] == "length"
    assert result["timing"]["new_tokens"] == 20 and result["timing"]["tokens_per_s"] > 0


def test_generate_streams_text(stories: Path) -> None:
    out = mdiedge("generate", "Once upon", "-n", "15", "--temperature", "0", "--nodes", "1",
                  *stories_args(stories))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time")
    assert "tok/s" in out.stderr


def test_several_samples(stories: Path) -> None:
    out = mdiedge("generate", "Once", "-n", "10", "--samples", "3", "--seed", "1", "--nodes", "2",
                  *stories_args(stories))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("--- sample") == 3


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--model", "/no/such/model"], "/no/such/model: model directory or file not found"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["generate", "hi", "--device", "tpu"], "unknown device 'tpu'"),
    (["generate", "hi", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["generate", "hi", "-n", "100000"], "exceeds the context"),
])
def test_errors_are_one_line(args: List[str], message: str, stories: Path) -> None:
    if "--model" not in args:
        args = args + stories_args(stories)
    out = mdiedge(*args)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr
