"""Bad command-line values and config values are one line, ``mdiedge: error: ...`` naming the
value, and a non-zero exit: never a traceback, never silently accepted. Real subprocesses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from commands import MDIEDGE

CASES = [
    (["worker", "--no-config", "--control-port", "-1"], "--control-port: expected a port 0..65535, got -1"),
    (["worker", "--no-config", "--control-port", "70000"], "--control-port: expected a port 0..65535, got 70000"),
    (["worker", "--no-config", "--data-port", "70000"], "--data-port: expected a port 0..65535, got 70000"),
    (["worker", "--no-config", "--log-level", "loud"], "--log-level: expected one of debug, info, warning, error, got 'loud'"),
    (["worker", "--no-config", "--idle-timeout", "nan"], "--idle-timeout: expected a number of seconds > 0, got nan"),
    (["worker", "--no-config", "--idle-timeout", "-1"], "--idle-timeout: expected a number of seconds > 0, got -1.0"),
    (["worker", "--no-config", "--busy-poll-us", "-1"], "--busy-poll-us: expected an integer 0..100000, got -1"),
    (["worker", "--no-config", "--busy-poll-us", "100001"], "--busy-poll-us: expected an integer 0..100000, got 100001"),
    (["worker", "--no-config", "--threads", "-5"], "--threads: expected an integer 0..4096, got -5"),
    (["worker", "--no-config", "--threads", "100000000000"], "--threads: expected an integer 0..4096, got 100000000000"),
    (["worker", "--no-config", "--secret-fd", "97"], "--secret-fd 97: cannot read the secret"),
    (["starter", "--control-port", "70000"], "--control-port: expected a port 0..65535, got 70000"),
    (["starter", "--log-level", "loud"], "--log-level: expected one of debug, info, warning, error, got 'loud'"),
    (["generate", "hi", "--starter", "notaurl"], "--starter: expected an http:// URL such as http://10.0.0.1:7600, got 'notaurl'"),
    (["generate", "hi", "--starter", "http://h:99999"], "--starter: expected an http:// URL"),
    (["status", "--starter", "notaurl"], "--starter: expected an http:// URL such as http://10.0.0.1:7600, got 'notaurl'"),
    (["generate", "hi", "--micro-batch", "-2"], "--micro-batch: expected an integer >= 0, got -2"),
    (["generate", "hi", "--stall-timeout", "0"], "--stall-timeout: expected a number of seconds > 0, got 0.0"),
    (["generate", "hi", "--stall-timeout", "nan"], "--stall-timeout: expected a number of seconds > 0, got nan"),
    (["generate", "hi", "--nodes", "0"], "--nodes: expected an integer >= 1, got 0"),
    (["bench", "--repeat", "0"], "--repeat: expected an integer 1..100, got 0"),
    (["bench", "--repeat", "1000000000"], "--repeat: expected an integer 1..100, got 1000000000"),
    (["status"], "no ring to ask: pass --starter URL, --ring FILE or --config FILE"),
    # the parser's own errors: one line naming the value, as the others
    (["genrate", "hi"], "no such command 'genrate'; did you mean generate?"),
    (["config", "int"], "no such command 'int'; did you mean init?"),
    (["frobnicate"], "no such command 'frobnicate'; the commands: generate, chat, serve"),
    (["generate", "hi", "--nodes", "abc"], "--nodes: expected an integer, got 'abc'"),
    (["chat", "--nodes=abc"], "--nodes: expected an integer, got 'abc'"),
    (["serve", "--nodes", "many"], "--nodes: expected an integer, got 'many'"),
    (["generate", "hi", "-n1.5"], "-n/--max-new-tokens: expected an integer, got '1.5'"),
    (["generate", "hi", "--temperature", "hot"], "--temperature: expected a number, got 'hot'"),
    (["generate"], "missing argument 'PROMPT'"),
    (["config", "init"], "missing argument 'KIND'"),
    (["generate", "hi", "--nodez", "2"], "no such option --nodez; did you mean --nodes"),
    (["generate", "hi", "there"], "unexpected extra argument"),
    (["config", "init", "wrker"], "unknown config kind 'wrker'; choose worker, starter or ring"),
]

# generate's values that need no model: refused before torch is imported or a bar is drawn,
# exit status 2 (a usage error, as the parser's own)
EARLY = [
    (["-n", "-5"], "-n/--max-new-tokens: expected an integer >= 1, got -5"),
    (["--samples", "0"], "--samples: expected an integer 1..4096, got 0"),
    (["--samples", "100000"], "--samples: expected an integer 1..4096, got 100000"),
    (["--nodes", "0"], "--nodes: expected an integer >= 1, got 0"),
    (["--temperature", "-1"], "--temperature: expected a number in [0, 2] (0: greedy), got -1.0"),
    (["--temperature", "inf"], "--temperature: expected a number in [0, 2] (0: greedy), got inf"),
    (["--temperature", "nan"], "--temperature: expected a number in [0, 2] (0: greedy), got nan"),
    (["--temperature", "2.5"], "--temperature: expected a number in [0, 2] (0: greedy), got 2.5"),
    (["--top-k", "-1"], "--top-k: expected an integer >= 0 (0: off), got -1"),
    (["--top-p", "2"], "--top-p: expected a number in (0, 1] (1: off), got 2.0"),
    (["--seed", "-1"], "--seed: expected an integer in [0, 2**40), got -1"),
    (["--device", "tpu"], "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--dtype", "float8"], "--dtype: expected one of float32, fp32, float16"),
    (["--compression", "zip"], "--compression 'zip' is not a codec"),
    (["--micro-batch", "-2"], "--micro-batch: expected an integer >= 0, got -2"),
]


def mdiedge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MDIEDGE, *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def assert_one_line(out: subprocess.CompletedProcess, message: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    assert lines[0].startswith("mdiedge: error: ") and message in lines[0], out.stderr


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_values_are_one_line_errors(args: List[str], message: str) -> None:
    out = mdiedge(*args)
    assert_one_line(out, message)
    assert out.returncode == 2, out.stderr  # every bad command-line value: a usage error


@pytest.mark.parametrize("args,message", EARLY, ids=[" ".join(a) for a, _ in EARLY])
def test_generate_refuses_bad_values_before_loading_torch(args: List[str], message: str) -> None:
    code = ("import sys\nfrom mdiedge.cli import app\n"
            f"sys.argv = ['mdiedge', 'generate', 'hi', *{args!r}]\n"
            "try:\n    app()\nexcept SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr  # status 2, no torch
    assert out.stderr.splitlines() == [f"mdiedge: error: {message}"] or \
        (len(out.stderr.splitlines()) == 1 and message in out.stderr), out.stderr


@pytest.mark.parametrize("value", ["100000000000", "1e23", "-5"])
def test_bad_threads_in_a_config_fail_the_check_and_the_worker(tmp_path: Path, value: str) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(f"[worker]\nthreads = {value}\n")
    assert_one_line(mdiedge("config", "check", str(config)), "worker.threads: expected an integer 0..4096")
    assert_one_line(mdiedge("worker", "--config", str(config)), "worker.threads: expected an integer 0..4096")
