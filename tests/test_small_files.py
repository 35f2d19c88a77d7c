"""Config, secret and API key files through the CLI, as issue 45 found them (finding 9): a
FIFO or a device is refused at once (it was waited on, or read to a MemoryError), a file over
its size cap (configs 1 MiB, secrets and keys 4 KiB) or a secret that is not printable text
is refused with one line naming the file and the reason, and a non-zero exit."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import List

import pytest

from commands import MDIEDGE
from mdiedge.base.defaults import MAX_CONFIG_BYTES, MAX_SECRET_BYTES

ROOT = Path(__file__).resolve().parent.parent
HUGE = 300_000_000  # bytes of NUL, as the probe's (a sparse file: nothing is written)
QUICK_S = 60  # the subprocess's limit: a wait on a FIFO or a read of /dev/zero never ends


def run(*args: str, stdin: object = subprocess.DEVNULL, **env: str) -> List[str]:
    """``mdiedge *args``'s stderr lines; it must fail with exit status 1 or 2, in time."""
    start = time.monotonic()
    done = subprocess.run([*MDIEDGE, *args], capture_output=True, text=True, stdin=stdin,
                          timeout=QUICK_S, env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
    assert done.returncode in (1, 2), (done.returncode, done.stderr[-2000:])
    assert time.monotonic() - start < QUICK_S
    return done.stderr.strip().splitlines()


def sparse(path: Path, size: int, mode: int = 0o600) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    path.chmod(mode)
    return path


def test_config_check_of_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "f.toml"
    os.mkfifo(fifo)
    assert run("config", "check", str(fifo)) == [
        f"mdiedge: error: {fifo}: not a regular file (a FIFO)"]


@pytest.mark.parametrize("args", [["config", "check", "/dev/zero"],
                                  ["worker", "--config", "/dev/zero"]])
def test_a_device_as_the_config(args: List[str]) -> None:
    assert run(*args) == ["mdiedge: error: /dev/zero: not a regular file (a character device)"]


def test_a_config_over_its_cap(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    assert run("config", "check", str(big)) == [
        f"mdiedge: error: {big}: too large ({big.stat().st_size} bytes; at most "
        f"{MAX_CONFIG_BYTES})"]


def test_a_huge_secret_file(tmp_path: Path) -> None:
    secret = sparse(tmp_path / "secret", HUGE)
    assert run("worker", "--no-config", "--control-port", "0", "--data-port", "0",
               MDIEDGE_SECRET_FILE=str(secret)) == [
        f"mdiedge: error: $MDIEDGE_SECRET_FILE: secret file {str(secret)!r}: too large "
        f"({HUGE} bytes; at most {MAX_SECRET_BYTES})"]
    config = tmp_path / "w.toml"
    config.write_text(f'[worker]\nsecret_file = "{secret}"\n')
    assert run("config", "check", str(config)) == [
        f"mdiedge: error: {config}: worker.secret_file: secret file {str(secret)!r}: too "
        f"large ({HUGE} bytes; at most {MAX_SECRET_BYTES})"]


def test_a_secret_of_nul_bytes(tmp_path: Path) -> None:
    secret = sparse(tmp_path / "secret", 32)
    lines = run("worker", "--no-config", "--control-port", "0", "--data-port", "0",
                MDIEDGE_SECRET_FILE=str(secret))
    assert len(lines) == 1 and lines[0].startswith(
        "mdiedge: error: $MDIEDGE_SECRET_FILE: the secret is not printable text (a control "
        "character at byte 0;"), lines


def test_a_secret_fd_on_dev_zero() -> None:
    with open("/dev/zero", "rb") as zero:
        lines = run("worker", "--no-config", "--control-port", "0", "--data-port", "0",
                    "--secret-fd", "0", stdin=zero)
    assert lines == [f"mdiedge: error: --secret-fd 0: expected a secret of at most "
                     f"{MAX_SECRET_BYTES} bytes, got {MAX_SECRET_BYTES + 3} bytes"]


@pytest.mark.parametrize("size, reason", [
    (HUGE, f"too large ({HUGE} bytes; at most {MAX_SECRET_BYTES})"),
    (40, "the key is not printable text")])
def test_an_api_key_file_of_nul_bytes(tmp_path: Path, size: int, reason: str) -> None:
    key = sparse(tmp_path / "key", size)
    assert run("serve", "--port", "0", "--api-key-file", str(key)) == [
        f"mdiedge: error: --api-key-file {key}: {reason}"]


def test_an_api_key_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    assert run("serve", "--port", "0", "--api-key-file", str(fifo)) == [
        f"mdiedge: error: --api-key-file {fifo} is not a regular file"]


def test_a_tokenizer_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    assert run("generate", "hi", "-n", "1", "--nodes", "1", "--model",
               str(ROOT / "models" / "nanollama"), "--tokenizer", str(fifo)) == [
        f"mdiedge: error: {fifo}: not a regular file (a FIFO)"]
