"""The command line in a real terminal (a pseudo-terminal): what a person sees."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from typing import Callable, List, Optional

import pytest
from commands import MDIEDGE

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def in_terminal(args: List[str], columns: int = 100, timeout: float = 120, status: int = 0,
                interrupt_at: Optional[float] = None,
                command: Optional[List[str]] = None,
                interrupt_when: Optional[Callable[[str], bool]] = None) -> str:
    """Run ``python -m mdiedge ARGS`` (or ``command`` ARGS) with stdin, stdout and stderr on
    one pseudo-terminal, its controlling terminal; ``interrupt_at``: seconds after the start
    at which Ctrl-C is typed; ``interrupt_when``: Ctrl-C is typed once it holds for the output
    so far. The exit status must be ``status``."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(columns))
    for key in ("NO_COLOR", "FORCE_COLOR", "TERM_PROGRAM"):
        env.pop(key, None)
    proc = subprocess.Popen([*(command or MDIEDGE), *args],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                            start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    chunks: List[bytes] = []
    started = time.monotonic()
    while time.monotonic() < started + timeout:
        if interrupt_at is not None and time.monotonic() >= started + interrupt_at:
            os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the command
            interrupt_at = None
        wait = 0.5 if interrupt_at is None else max(0.0, started + interrupt_at - time.monotonic())
        ready, _, _ = select.select([master], [], [], wait)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
            if interrupt_when is not None and interrupt_when(b"".join(chunks).decode(errors="replace")):
                os.write(master, b"\x03")
                interrupt_when = None
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=10) == status, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def screen(raw: str) -> List[str]:
    """The lines a terminal shows after ``raw``: text, CR, LF, cursor up (ESC[nA) and erase
    line (ESC[2K, ESC[K) followed; other escapes ignored. Enough for rich's bars."""
    lines: List[List[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|"
                            r"\x1b[()][0-9A-Za-z]|\x1b[=>78]|[\r\n]|[^\x1b\r\n]+", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
            lines += [[] for _ in range(row + 1 - len(lines))]
        elif token.startswith("\x1b[") and token[-1] == "A":
            row = max(0, row - int(token[2:-1] or 1))
        elif token in ("\x1b[2K", "\x1b[K", "\x1b[0K"):
            lines[row] = [] if token == "\x1b[2K" else lines[row][:col]
        elif not token.startswith("\x1b"):
            line = lines[row] + [" "] * max(0, col - len(lines[row]))
            line[col:col + len(token)] = list(token)
            lines[row], col = line, col + len(token)
    return ["".join(line).rstrip() for line in lines]


def as_seen(raw: str) -> str:
    """The text as the terminal shows it: escapes removed, a line overwritten after \\r gone."""
    text = ANSI.sub("", raw).replace("\r\n", "\n")
    return "\n".join(line.split("\r")[-1] for line in text.split("\n"))


def test_streamed_text_is_continuous_in_a_terminal() -> None:
    args = ["generate", "ROMEO:", "-n", "40", "--nodes", "1", "--seed", "1"]
    out = subprocess.run([*MDIEDGE, *args, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = "ROMEO:" + json.loads(out.stdout)["samples"][0]["text"]
    seen = as_seen(in_terminal(args))
    assert expected in seen, (expected, seen)
    assert re.search(r"\[40 tokens in [0-9.]+ s, [0-9.]+ tok/s(; set-up [0-9.]+ s)?\]", seen), seen


SECRET = "status-secret-0123456789abcdef0123"


def fake_nodes() -> List[dict]:
    from mdiedge.runtime.protocol import NodeStatus

    starter = NodeStatus("starter", "starter", "ready", address="192.168.100.200:7600",
                         version="0.1.0", model="nanollama", hash="0123456789abcdef",
                         device="cpu", layers=[0, 2], rss_bytes=412 << 20, weight_bytes=9 << 20,
                         kv_bytes=3 << 20, slots_in_use=0, messages=12345, tokens=678,
                         busy_fraction=0.4567, link_rtt_ms=0.123, uptime_s=12345.6, pid=1)
    worker = NodeStatus(**dict(starter.to_json(), role="worker", name="worker-kitchen",
                               state="busy", address="192.168.100.201:7601", layers=[2, 5]))
    down = NodeStatus.down("worker", "worker-garage", "192.168.100.202:7601",
                           "worker-garage is unreachable: connection refused")
    return [n.to_json() for n in (starter, worker, down)]


def fake_starter() -> "object":
    """A control server answering GET /status like a starter, requiring SECRET."""
    from mdiedge.runtime.auth import Authenticator
    from mdiedge.runtime.control import ControlServer

    nodes = fake_nodes()
    server = ControlServer("127.0.0.1", 0, {("GET", "/status"): lambda b, r, q: {"nodes": nodes}},
                           auth=Authenticator(SECRET.encode()))
    server.start()
    return server


def status(url: str, columns: int, secret: str = SECRET, *more: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDIEDGE_SECRET")}
    env.update(COLUMNS=str(columns), MDIEDGE_SECRET=secret) if secret else env.update(COLUMNS=str(columns))
    return subprocess.run([*MDIEDGE, "status", "--starter", url, *more],
                          capture_output=True, text=True, timeout=60, env=env)


def test_status_table_fits_and_says_why_a_node_is_down() -> None:
    server = fake_starter()
    try:
        for columns in (80, 120):
            out = status(server.url, columns)  # type: ignore[attr-defined]
            assert out.returncode == 69, out.stdout + out.stderr
            lines = out.stdout.splitlines()
            assert "…" not in out.stdout and max(len(line) for line in lines) <= columns, out.stdout
            assert "worker-kitchen" in out.stdout and "linked" in out.stdout
            assert "worker-garage: down: worker-garage is unreachable: connection refused" in out.stdout
        wide = status(server.url, 80, SECRET, "--wide")  # type: ignore[attr-defined]
        assert wide.returncode == 69 and "weights MB" in wide.stdout and "version" in wide.stdout
        assert "…" not in wide.stdout
    finally:
        server.stop()  # type: ignore[attr-defined]


def test_status_of_a_starter_that_refuses_us_is_unauthorized(tmp_path) -> None:
    server = fake_starter()
    try:
        out = status(server.url, 120, "")  # type: ignore[attr-defined]
        assert out.returncode == 77, out.stdout + out.stderr
        assert "unauthorized" in out.stdout and "down" not in out.stdout
        out = status(server.url, 120, "another-secret-0123456789abcdef01", "--json")  # type: ignore[attr-defined]
        assert out.returncode == 77 and json.loads(out.stdout)["unauthorized"] == ["starter"]
    finally:
        server.stop()  # type: ignore[attr-defined]


def test_generate_through_a_starter_imports_no_torch() -> None:
    """One request to a starter needs no torch (it costs seconds to import)."""
    from mdiedge.runtime.auth import Authenticator
    from mdiedge.runtime.control import ControlServer

    def generate(body: dict, raw: bytes, query: dict) -> dict:
        return {"prompt": body["prompt"], "samples": [{"index": 0, "text": " there",
                                                       "finish_reason": "length"}],
                "timing": {"new_tokens": 1, "total_s": 0.01, "tokens_per_s": 100.0}}

    server = ControlServer("127.0.0.1", 0, {("POST", "/generate"): generate},
                           auth=Authenticator(SECRET.encode())).start()
    code = ("import sys\nfrom mdiedge.cli import app\n"
            f"sys.argv = ['mdiedge', 'generate', 'hi', '-n', '1', '--starter', {server.url!r}]\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)\n")
    env = dict(os.environ, MDIEDGE_SECRET=SECRET)
    env.pop("MDIEDGE_SECRET_FILE", None)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=env)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["hi there", "False"], out.stdout + out.stderr


def test_a_bad_value_is_refused_at_once_with_no_bar() -> None:
    """A value that needs no model is refused before torch loads or a bar is drawn."""
    started = time.monotonic()
    raw = in_terminal(["generate", "hi", "-n", "-5"], status=2)
    assert "━" not in raw and "0/-5" not in raw, raw
    assert [line for line in screen(raw) if line] == \
        ["mdiedge: error: -n/--max-new-tokens: expected an integer >= 1, got -5"], raw
    assert time.monotonic() - started < 30


def test_an_error_after_the_bar_has_a_line_of_its_own() -> None:
    """An error found while the bar runs (here: the budget against the model's context) is
    printed once the bar has left its line: the screen shows the error alone."""
    raw = in_terminal(["generate", "hi", "-n", "100000", "--nodes", "1"], status=2)
    lines = [line for line in screen(raw) if line]
    assert lines == ["mdiedge: error: prompt of 2 tokens plus 100000 new tokens exceeds the "
                     "context of 1024 tokens"], (lines, raw)


# Ctrl-C the moment torch's C start-up imports numpy: torch clears any error raised there, a
# KeyboardInterrupt included, so without care the interrupt is lost and the generation runs
CTRL_C_IN_TORCH_IMPORT = """
import os, runpy, signal, sys
class PressCtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, PressCtrlC())
sys.argv = ["mdiedge", *sys.argv[1:]]
runpy.run_module("mdiedge", run_name="__main__")
"""


def test_ctrl_c_while_torch_imports_stops_the_command() -> None:
    raw = in_terminal(["generate", "ROMEO:", "-n", "5", "--nodes", "1", "--seed", "1"],
                      status=130, command=[sys.executable, "-c", CTRL_C_IN_TORCH_IMPORT])
    lines = [line for line in screen(raw) if line]
    assert lines and lines[-1] == "mdiedge: error: interrupted", (lines, raw)
    assert "ROMEO:" not in raw and "tokens in" not in raw and "Traceback" not in raw, raw


# Ctrl-C inside code run from a string (as dataclasses and typing do while modules load): in
# CPython that marks the process as ended by an unhandled Ctrl-C, and a ``python -m`` run then
# kills itself with SIGINT on the way out, whatever status the program exits with
CTRL_C_IN_EXEC = """
import runpy, sys
class PressCtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "mdiedge.cli":
            sys.meta_path.remove(self)
            exec("import os, signal; os.kill(os.getpid(), signal.SIGINT)\\nfor i in range(99): pass")
sys.meta_path.insert(0, PressCtrlC())
runpy.run_module("mdiedge", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("args", [["generate", "ROMEO:", "-n", "5", "--nodes", "1"], ["--help"],
                                  ["generate", "--nodes", "0"]])
def test_ctrl_c_while_the_command_line_loads_is_status_130(args: List[str], tmp_path) -> None:
    """Held back until the command starts, or until typer is done when no command runs (help,
    a usage error): one line, status 130 (not a death by SIGINT), no traceback."""
    (tmp_path / "press_ctrl_c.py").write_text(CTRL_C_IN_EXEC)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "press_ctrl_c", *args], capture_output=True,
                          text=True, timeout=120, env=env)
    assert (proc.returncode, proc.stderr.splitlines()[-1:]) == \
        (130, ["mdiedge: error: interrupted"]), proc.stderr
    assert "Traceback" not in proc.stderr and "ROMEO:" not in proc.stdout, proc.stderr


@pytest.mark.parametrize("at", [0.2, 0.6])
def test_ctrl_c_at_any_moment_is_one_line_and_status_130(at: float) -> None:
    """Ctrl-C typed at 0.2 s (the command line loading) and 0.6 s (torch loading, or the
    nodes starting on a faster machine): one line, status 130, no text generated."""
    raw = in_terminal(["generate", "ROMEO:", "-n", "200"], status=130, interrupt_at=at)
    lines = [line.replace("^C", "") for line in screen(raw)]
    assert [line for line in lines if line] == ["mdiedge: error: interrupted"], (lines, raw)
    assert "Traceback" not in raw and "tokens in" not in raw, raw


def test_ctrl_c_after_text_mid_line_gives_the_error_a_line_of_its_own() -> None:
    """Ctrl-C while the text streams, its line unfinished: the error starts a line of its
    own (not ``...text^Cmdiedge: error: ...``); status 130."""
    def mid_line(raw: str) -> bool:
        text = as_seen(raw)
        return "ROMEO:" in text and len(text.split("ROMEO:", 1)[1]) > 20 and \
            bool(re.search(r"\w$", text))

    raw = in_terminal(["generate", "ROMEO:", "-n", "900", "--nodes", "1", "--seed", "1"],
                      status=130, interrupt_when=mid_line)
    lines = [line for line in screen(raw) if line]
    assert lines[-1].replace("^C", "") == "mdiedge: error: interrupted", (lines, raw)
    assert "ROMEO:" in lines[0] and "Traceback" not in raw and "tokens in" not in raw, raw


def test_samples_are_printed_as_they_finish() -> None:
    """Several samples on a terminal: each is printed, labelled, as it finishes: with seed 3
    sample 1 meets the stop string after 9 tokens, sample 2 after 17, sample 0 after 24."""
    args = ["generate", "ROMEO:", "-n", "30", "--nodes", "1", "--samples", "3", "--stop", "\n\n",
            "--seed", "3"]
    out = subprocess.run([*MDIEDGE, *args, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert [(s["index"], s["finish_reason"], len(s["token_ids"]))
            for s in json.loads(out.stdout)["samples"]] == [(0, "stop", 24), (1, "stop", 9),
                                                            (2, "stop", 17)], out.stdout
    seen = "\n".join(screen(in_terminal(args)))
    assert re.findall(r"--- sample (\d) \((\w+)\) ---", seen) == \
        [("1", "stop"), ("2", "stop"), ("0", "stop")], seen
    assert ", seed" not in seen  # given, so not repeated


def test_a_drawn_seed_is_shown_and_repeats_the_run() -> None:
    """No --seed: a seed is drawn (two runs differ), named in the summary line and in --json;
    --seed with it prints the same text again."""
    args = ["generate", "ROMEO:", "-n", "20", "--nodes", "1"]
    first, second = (subprocess.run([*MDIEDGE, *args, "--json"],
                                    capture_output=True, text=True, timeout=120)
                     for _ in range(2))
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["seed"] != b["seed"] and a["samples"][0]["text"] != b["samples"][0]["text"]
    seen = "\n".join(screen(in_terminal(args)))
    seed = re.search(r"\[20 tokens in [0-9.]+ s, [0-9.]+ tok/s, seed (\d+)\]", seen)
    assert seed, seen
    again = "\n".join(screen(in_terminal(args + ["--seed", seed.group(1)])))
    assert again.split("[")[0] == seen.split("[")[0] and ", seed" not in again, (seen, again)
