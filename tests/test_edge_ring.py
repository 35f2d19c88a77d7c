"""bin/edge-ring: a command runs in a private network namespace whose loopback is rate-limited
by tc tbf (skipped, with the reason, without root, unshare or tc)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bin" / "edge-ring"
MISSING = [t for t in ("unshare", "tc", "ip") if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING) or os.geteuid() != 0,
    reason=f"needs root and unshare, tc, ip (missing: {', '.join(MISSING) or 'root'})")

PROBE = ("import subprocess, sys, importlib.util as u; spec = u.spec_from_file_location('e', "
         f"{str(SCRIPT)!r}, loader=__import__('importlib.machinery').machinery.SourceFileLoader("
         f"'e', {str(SCRIPT)!r})); e = u.module_from_spec(spec); spec.loader.exec_module(e); "
         "print(subprocess.run(['tc', 'qdisc', 'show', 'dev', 'lo'], capture_output=True, "
         "text=True).stdout.strip()); print('MBIT', e.raw_mbit_s(0.5))")


def test_the_command_runs_on_a_rate_limited_loopback() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--rate", "20mbit", "--", sys.executable,
                           "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "tbf" in done.stdout and "rate 20Mbit" in done.stdout
    mbit = float(done.stdout.split("MBIT")[1])
    assert 5 < mbit < 45, done.stdout  # shaped (the burst adds a little), not loopback speed


def test_the_host_loopback_is_left_alone() -> None:
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    assert "tbf" not in shown.stdout


def test_a_bad_rate_is_one_line_and_exit_77() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--rate", "fast", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 77 and done.stderr.count("\n") == 1
    assert "tc qdisc add dev lo root tbf rate fast" in done.stderr


def test_delay_ms_routes_every_ring_link_through_a_relay(ring_model: Path,
                                                          tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    done = subprocess.run([sys.executable, str(SCRIPT), "--rate", "1gbit", "--measure",
                           "--model", str(ring_model), "--text", str(text), "--codecs", "none",
                           "--nodes", "3", "--prompt-tokens", "8", "--new-tokens", "4",
                           "--repeats", "1", "--delay-ms", "20", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    run = result["runs"]["none"]
    assert result["delay_ms"] == 20
    assert [(l["from"], l["to"]) for l in run["links"]] == \
        [("starter", "w1"), ("w1", "w2"), ("w2", "starter")]
    assert run["ttft_s"] >= 3 * 0.020  # the prefill crosses three delayed hops
    assert run["decode_tok_s"] < 1 / (3 * 0.020)  # so does every decode token


def test_delay_ms_needs_measure() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--rate", "1gbit", "--delay-ms", "5",
                           "--", "true"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--delay-ms needs --measure" in done.stderr
