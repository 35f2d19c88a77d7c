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
from typing import List

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def in_terminal(args: List[str], columns: int = 100, timeout: float = 120) -> str:
    """Run ``python -m mdiedge ARGS`` with stdin, stdout and stderr on one pseudo-terminal."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(columns))
    for key in ("NO_COLOR", "FORCE_COLOR", "TERM_PROGRAM"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "mdiedge", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks: List[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=10) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def as_seen(raw: str) -> str:
    """The text as the terminal shows it: escapes removed, a line overwritten after \\r gone."""
    text = ANSI.sub("", raw).replace("\r\n", "\n")
    return "\n".join(line.split("\r")[-1] for line in text.split("\n"))


def test_streamed_text_is_continuous_in_a_terminal() -> None:
    args = ["generate", "ROMEO:", "-n", "40", "--nodes", "1", "--seed", "1"]
    out = subprocess.run([sys.executable, "-m", "mdiedge", *args, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = "ROMEO:" + json.loads(out.stdout)["samples"][0]["text"]
    seen = as_seen(in_terminal(args))
    assert expected in seen, (expected, seen)
    assert re.search(r"\[40 tokens in [0-9.]+ s, [0-9.]+ tok/s\]", seen), seen
