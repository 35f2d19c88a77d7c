"""Settings files (mdiedge.base.settings) and ring files on top of them; no torch needed."""
from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from mdiedge.base import defaults
from mdiedge.base import settings as settings_module
from mdiedge.base.errors import ConfigError
from mdiedge.base.nodes import NodeSpec
from mdiedge.base.ringfile import load_ring
from mdiedge.base.settings import (STARTER_SCHEMA, WORKER_SCHEMA, WORKERS_SCHEMA, Settings,
                                   StarterSettings, WorkerSettings, check_config, find_config,
                                   load_settings, parse_bytes, read_secret)

GiB = 1024 ** 3


def write(tmp_path: Path, text: str, name: str = "mdiedge.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    message = str(e.value)
    assert "\n" not in message and "\r" not in message
    assert message.startswith(f"{path}: ")
    return e.value


# ------------------------------------------------------------------------------ valid files

WORKER_FILE = """
[worker]
name = "w1"
host = "0.0.0.0"
control_port = 7710
data_port = 7711
threads = 2
cache_dir = "/var/lib/mdiedge"
log_level = "debug"
idle_timeout_s = 90
secret_file = "/etc/mdiedge/secret"
insecure = false
model = "/models/tinyllama"
layers = [10, 22]
device = "cuda:1"
dtype = "bfloat16"
"""

STARTER_FILE = """
[starter]
host = "10.0.0.1"
control_port = 7601
model = "/models/tinyllama"
tokenizer = "/models/tok.model"
device = "cuda"
dtype = "float16"
weight = 2
memory = "4GiB"
layers = [0, 6]
max_payload = "64MiB"
timeout_s = 12.5
secret = "0123456789abcdef"
"""

RING_FILE = """
[starter]
host = "10.0.0.1"
memory = 1000

[[workers]]
host = "10.0.0.2"
control_port = 7700
device = "cuda"
weight = 2.5
memory = "6GiB"
layers = [6, 14]

[[workers]]
name = "jetson"
host = "10.0.0.3"
control_port = 7700

[[workers]]
host = "10.0.0.3"
control_port = 7701
"""


def test_worker_file(tmp_path: Path) -> None:
    path = write(tmp_path, WORKER_FILE)
    s = load_settings(path)
    assert s.starter is None and s.workers == () and s.source == str(path)
    assert s.worker == WorkerSettings(
        name="w1", host="0.0.0.0", control_port=7710, data_port=7711, threads=2,
        cache_dir="/var/lib/mdiedge", log_level="debug", idle_timeout_s=90.0,
        secret_file="/etc/mdiedge/secret", insecure=False, model="/models/tinyllama",
        layers=(10, 22), device="cuda:1", dtype="bfloat16")
    assert isinstance(s.worker.idle_timeout_s, float)
    assert s.worker.source == str(path)
    assert "threads" in s.worker.keys_set and "secret" not in s.worker.keys_set


def test_starter_file(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, STARTER_FILE))
    assert s.worker is None and s.workers == ()
    assert s.starter == StarterSettings(
        host="10.0.0.1", control_port=7601, model="/models/tinyllama",
        tokenizer="/models/tok.model", device="cuda", dtype="float16", weight=2.0,
        memory=4 * GiB, layers=(0, 6), max_payload=64 << 20, timeout_s=12.5,
        secret="0123456789abcdef")
    assert isinstance(s.starter.weight, float)


def test_ring_file(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, RING_FILE))
    assert s.starter == StarterSettings(host="10.0.0.1", memory=1000)
    assert s.workers == (
        NodeSpec(name="w1", host="10.0.0.2", control_port=7700, device="cuda", weight=2.5,
                 memory=6 * GiB, layers=(6, 14)),
        NodeSpec(name="jetson", host="10.0.0.3", control_port=7700),
        NodeSpec(name="w3", host="10.0.0.3", control_port=7701),
    )


@pytest.mark.parametrize("text,expected", [
    ("", Settings(None, None, (), "")),
    ("# only a comment\n", Settings(None, None, (), "")),
    ("[worker]\n", Settings(WorkerSettings(), None, (), "")),
    ("[starter]\n", Settings(None, StarterSettings(), (), "")),
    ("workers = []\n", Settings(None, None, (), "")),
    ('worker = { name = "inline" }\n', Settings(WorkerSettings(name="inline"), None, (), "")),
    ('workers = [{ host = "h", control_port = 1 }]\n',
     Settings(None, None, (NodeSpec("w1", "h", 1),), "")),
    ("[worker]\ncontrol_port = 0\ndata_port = 0\n",  # 0: any free port, twice is fine
     Settings(WorkerSettings(control_port=0, data_port=0), None, (), "")),
])
def test_defaults(tmp_path: Path, text: str, expected: Settings) -> None:
    path = write(tmp_path, text)
    got = load_settings(path)
    assert (got.worker, got.starter, got.workers) == (expected.worker, expected.starter,
                                                     expected.workers)


def test_defaults_come_from_the_defaults_module() -> None:
    w, s = WorkerSettings(), StarterSettings()
    assert (w.name, w.host, w.threads, w.log_level) == ("worker", "127.0.0.1", 0, "info")
    assert (w.control_port, w.data_port, w.idle_timeout_s) == \
        (defaults.WORKER_CONTROL_PORT, defaults.WORKER_DATA_PORT, defaults.IDLE_TIMEOUT_S)
    assert (s.host, s.control_port, s.device, s.dtype, s.weight) == \
        ("127.0.0.1", defaults.STARTER_CONTROL_PORT, "cpu", "float32", 1.0)
    assert (s.timeout_s, s.max_payload) == (defaults.RING_TIMEOUT_S, defaults.MAX_PAYLOAD)


def test_dtype_names_are_the_compute_dtypes(tmp_path: Path) -> None:
    from mdiedge.base.dtypes import COMPUTE_NAMES

    for name in COMPUTE_NAMES:
        starter = load_settings(write(tmp_path, f'[starter]\ndtype = "{name}"\n')).starter
        assert starter is not None and starter.dtype == name


def test_schemas_cover_the_dataclass_fields() -> None:
    extra = {"source", "keys_set"}
    assert set(WORKER_SCHEMA) == {f.name for f in fields(WorkerSettings)} - extra
    assert set(STARTER_SCHEMA) == {f.name for f in fields(StarterSettings)} - extra
    assert set(WORKERS_SCHEMA) == {f.name for f in fields(NodeSpec)}


def test_settings_are_frozen(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, WORKER_FILE))
    with pytest.raises(Exception):
        s.worker.name = "x"  # type: ignore[misc, union-attr]


def test_secret_not_in_repr() -> None:
    assert "0123456789abcdef" not in repr(StarterSettings(secret="0123456789abcdef"))


# ------------------------------------------------------------------------------ errors

W = "[worker]\n"
S = "[starter]\n"
R = '[[workers]]\nhost = "h"\ncontrol_port = 7700\n'  # a valid first entry

ERRORS = [
    # unknown keys and tables
    (W + "contro_port = 1\n", "worker.contro_port", "unknown key (did you mean 'control_port'?)"),
    (W + "zzz = 1\n", "worker.zzz", "unknown key (known: 'name', 'host', "),
    (W + '"a b" = 1\n', 'worker."a b"', "unknown key"),
    (S + "data_port = 1\n", "starter.data_port", "unknown key"),
    (R + '[[workers]]\nhost = "g"\ncontrol_port = 1\ndata_port = 2\n', "workers[1].data_port",
     "unknown key"),
    ("[wrker]\n", "wrker", "unknown table (did you mean [worker]?)"),
    ("[ring]\n", "ring", "unknown table (known: [worker], [starter], [[workers]])"),
    ("name = 'w1'\n", "name", "unknown table"),
    # table shapes
    ("worker = 3\n", "worker", "expected a table, got 3"),
    ("[[worker]]\n", "worker", "expected a table [worker], got an array of tables [[worker]]"),
    ("starter = [1, 2]\n", "starter", "expected a table, got [1, 2]"),
    ("[workers]\n", "workers", "expected an array of tables [[workers]], got a table [workers]"),
    ("workers = 3\n", "workers", "expected an array of tables [[workers]], got 3"),
    ("workers = [1]\n", "workers[0]", "expected a table, got 1"),
    # types (bool is not an int) and ranges
    (W + 'control_port = "7700"\n', "worker.control_port",
     "expected an integer 0..65535, got '7700'"),
    (W + "control_port = true\n", "worker.control_port", "expected an integer 0..65535, got True"),
    (W + "control_port = 7700.0\n", "worker.control_port", "got 7700.0"),
    (W + "control_port = 70000\n", "worker.control_port",
     "expected an integer 0..65535, got 70000"),
    (W + "data_port = -1\n", "worker.data_port", "expected an integer 0..65535, got -1"),
    (W + "control_port = 7700\ndata_port = 7700\n", "worker.data_port",
     "expected a port other than worker.control_port, got 7700"),
    (W + "threads = -1\n", "worker.threads", "expected an integer 0..4096, got -1"),
    (W + "threads = false\n", "worker.threads", "expected an integer 0..4096, got False"),
    (W + "threads = 100000000000\n", "worker.threads",  # passed, then crashed the worker
     "expected an integer 0..4096, got 100000000000"),
    (W + "threads = 1e23\n", "worker.threads", "expected an integer 0..4096, got 1e+23"),
    (W + "idle_timeout_s = 0\n", "worker.idle_timeout_s", "expected a number > 0, got 0"),
    (W + "idle_timeout_s = -2.5\n", "worker.idle_timeout_s", "got -2.5"),
    (W + "busy_poll_us = -1\n", "worker.busy_poll_us", "expected an integer 0..100000, got -1"),
    (W + "busy_poll_us = 1.5\n", "worker.busy_poll_us", "got 1.5"),
    (W + "idle_timeout_s = nan\n", "worker.idle_timeout_s", "got nan"),
    (W + "idle_timeout_s = inf\n", "worker.idle_timeout_s", "got inf"),
    (W + "idle_timeout_s = true\n", "worker.idle_timeout_s", "got True"),
    (W + 'idle_timeout_s = "60"\n', "worker.idle_timeout_s", "got '60'"),
    (W + 'log_level = "verbose"\n', "worker.log_level",
     "expected one of debug, info, warning, error, got 'verbose'"),
    (W + 'log_level = "INFO"\n', "worker.log_level", "got 'INFO'"),
    (W + 'insecure = "yes"\n', "worker.insecure", "expected true or false, got 'yes'"),
    (W + "insecure = 1\n", "worker.insecure", "expected true or false, got 1"),
    (W + 'device = "gpu"\n', "worker.device", "expected cpu, cuda or cuda:N, got 'gpu'"),
    (W + 'device = "cuda:x"\n', "worker.device", "got 'cuda:x'"),
    (W + 'dtype = "float64"\n', "worker.dtype", "expected one of float32, fp32, "),
    (W + 'name = ""\n', "worker.name", "expected a non-empty string, got ''"),
    (W + "name = 3\n", "worker.name", "expected a non-empty string, got 3"),
    (W + 'host = ""\n', "worker.host", "expected a host name or address, got ''"),
    (W + 'host = "a b"\n', "worker.host", "got 'a b'"),
    (W + "cache_dir = 5\n", "worker.cache_dir", "expected a directory path, got 5"),
    (W + "model = [1]\n", "worker.model", "expected a model path, got [1]"),
    (W + "secret_file = 1979-05-27\n", "worker.secret_file",
     "expected a file path, got datetime.date(1979, 5, 27)"),
    (S + "weight = 0\n", "starter.weight", "expected a number > 0, got 0"),
    (S + "control_port = 65536\n", "starter.control_port", "got 65536"),
    (S + 'tokenizer = ""\n', "starter.tokenizer", "expected a tokenizer path, got ''"),
    (S + "timeout_s = -1\n", "starter.timeout_s", "expected a number > 0, got -1"),
    # sizes
    (S + 'memory = "4 gigs"\n', "starter.memory",
     "expected a size in bytes such as 4GiB, 512MB or 4096, got '4 gigs'"),
    (S + "memory = 4.5\n", "starter.memory", "got 4.5"),
    (S + "memory = -1\n", "starter.memory", "got -1"),
    (S + "memory = 0\n", "starter.memory", "got 0"),
    (S + 'memory = "0GiB"\n', "starter.memory", "got '0GiB'"),
    (S + "memory = true\n", "starter.memory", "got True"),
    (S + 'max_payload = "64XB"\n', "starter.max_payload", "got '64XB'"),
    (R + 'memory = "lots"\n', "workers[0].memory", "got 'lots'"),
    # layers
    (S + "layers = [1]\n", "starter.layers",
     "expected [first, last] with 0 <= first < last, got [1]"),
    (S + "layers = [1, 2, 3]\n", "starter.layers", "got [1, 2, 3]"),
    (S + "layers = [2, 1]\n", "starter.layers", "got [2, 1]"),
    (S + "layers = [3, 3]\n", "starter.layers", "got [3, 3]"),
    (S + "layers = [-1, 3]\n", "starter.layers", "got [-1, 3]"),
    (S + 'layers = ["a", 2]\n', "starter.layers", "got ['a', 2]"),
    (S + "layers = [true, 2]\n", "starter.layers", "got [True, 2]"),
    (S + "layers = [0.0, 2.0]\n", "starter.layers", "got [0.0, 2.0]"),
    (S + 'layers = "0-3"\n', "starter.layers", "got '0-3'"),
    (W + "layers = [0, 3]\n", "worker.layers", "only allowed together with worker.model"),
    (R + "layers = [4, 2]\n", "workers[0].layers", "got [4, 2]"),
    # secrets
    (W + 'secret = "0123456789abcdef"\nsecret_file = "/s"\n', "worker.secret_file",
     "not allowed together with worker.secret (set only one)"),
    (S + 'secret = "0123456789abcdef"\nsecret_file = "/s"\n', "starter.secret_file",
     "not allowed together with starter.secret"),
    (W + 'secret_file = "/s"\ninsecure = true\n', "worker.insecure",
     "true contradicts worker.secret_file"),
    (S + 'secret = "0123456789abcdef"\ninsecure = true\n', "starter.insecure",
     "true contradicts starter.secret"),
    (W + 'secret = "hunter2"\n', "worker.secret",
     "expected a secret of at least 16 bytes, got 7 bytes (not shown)"),
    (W + "secret = 12345\n", "worker.secret", "expected a string, got an integer"),
    # [[workers]]
    (R + '[[workers]]\ncontrol_port = 7700\n', "workers[1].host", "missing required key"),
    (R + '[[workers]]\nhost = "g"\n', "workers[1].control_port", "missing required key"),
    (R + '[[workers]]\nhost = 5\ncontrol_port = 1\n', "workers[1].host",
     "expected a host name or address, got 5"),
    ('[[workers]]\nhost = "h"\ncontrol_port = 0\n', "workers[0].control_port",
     "expected an integer 1..65535, got 0"),
    ('[[workers]]\nhost = "h"\ncontrol_port = "7700"\n', "workers[0].control_port",
     "got '7700'"),
    (R + 'weight = -1\n', "workers[0].weight", "expected a number > 0, got -1"),
    (R + 'device = "tpu"\n', "workers[0].device", "got 'tpu'"),
    ('[[workers]]\nname = "a"\nhost = "h"\ncontrol_port = 1\n'
     '[[workers]]\nname = "a"\nhost = "g"\ncontrol_port = 1\n', "workers[1].name",
     "duplicate worker name 'a' (also workers[0])"),
    ('[[workers]]\nname = "w2"\nhost = "h"\ncontrol_port = 1\n'
     '[[workers]]\nhost = "g"\ncontrol_port = 1\n', "workers[1].name",
     "duplicate worker name 'w2' (also workers[0])"),
    ('[[workers]]\nhost = "h"\ncontrol_port = 1\n[[workers]]\nhost = "h"\ncontrol_port = 1\n',
     "workers[1].control_port", "h:1 is already workers[0]"),
]


@pytest.mark.parametrize("text,key,expected", ERRORS)
def test_errors(tmp_path: Path, text: str, key: str, expected: str) -> None:
    path = write(tmp_path, text)
    message = str(config_error(path))
    assert message.startswith(f"{path}: {key}: "), message
    assert expected in message, message


def test_secret_value_never_shown(tmp_path: Path) -> None:
    message = str(config_error(write(tmp_path, W + 'secret = "tooshort"\n')))
    assert "tooshort" not in message


def test_first_error_wins_in_schema_order(tmp_path: Path) -> None:
    path = write(tmp_path, W + 'data_port = "x"\ncontrol_port = "y"\n')
    assert f"{path}: worker.control_port: " in str(config_error(path))


@pytest.mark.parametrize("text,line", [
    ("[worker\n", 1),
    ("[worker]\nname = \n", 2),
    ('[worker]\nname = "a"\nname = "b"\n', 3),
    ("[worker]\n[worker]\n", 2),
    ("[worker]\nlayers = [1, 2\n", 3),
])
def test_toml_syntax_errors(tmp_path: Path, text: str, line: int) -> None:
    path = write(tmp_path, text)
    message = str(config_error(path))
    assert message.startswith(f"{path}: TOML syntax error: ")
    assert f"line {line}" in message


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[worker]\nname = "\xff"\n')
    assert str(config_error(path)) == f"{path}: TOML syntax error: not valid UTF-8 (at line 2)"


def test_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    assert str(config_error(path)) == f"{path}: file not found"


def test_directory(tmp_path: Path) -> None:
    assert "is a directory" in str(config_error(tmp_path))


# ------------------------------------------------------------------------------ parse_bytes


@pytest.mark.parametrize("value,expected", [
    (1, 1), (4096, 4096), ("4096", 4096), ("4GiB", 4 * GiB), ("4 gib", 4 * GiB),
    ("512MB", 512 * 10 ** 6), ("1.5KiB", 1536), (" 2 kb ", 2000), ("1TiB", 1024 ** 4),
    ("3b", 3), ("10B", 10), ("1.0000000001", 1),
])
def test_parse_bytes(value: Any, expected: int) -> None:
    assert parse_bytes(value, "x") == expected


@pytest.mark.parametrize("value", [0, -1, True, 4.5, "", "GiB", "4 gigs", "-4GiB", "0.4b",
                                   "9" * 400, "1e9", None, [4]])
def test_parse_bytes_errors(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^f\.toml: starter\.memory: expected a size"):
        parse_bytes(value, "f.toml: starter.memory")


def test_ringfile_reexports_parse_bytes() -> None:
    from mdiedge.base import ringfile

    assert ringfile.parse_bytes is parse_bytes


def test_no_torch_needed() -> None:
    code = "import sys, mdiedge.base.settings, mdiedge.base.ringfile; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------------------ find_config


@pytest.fixture
def no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SYSTEM_CONFIG points at a file that does not exist yet; no $MDIEDGE_CONFIG."""
    system = tmp_path / "etc" / "mdiedge.toml"
    monkeypatch.setattr(settings_module, "SYSTEM_CONFIG", system)
    monkeypatch.delenv("MDIEDGE_CONFIG", raising=False)
    return system


def test_find_config_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           no_system_config: Path) -> None:
    assert find_config(None) is None
    no_system_config.parent.mkdir()
    no_system_config.write_text("")
    assert find_config(None) == no_system_config
    env_file = write(tmp_path, "", "env.toml")
    monkeypatch.setenv("MDIEDGE_CONFIG", str(env_file))
    assert find_config(None) == env_file
    explicit = write(tmp_path, "", "explicit.toml")
    assert find_config(str(explicit)) == explicit
    monkeypatch.setenv("MDIEDGE_CONFIG", "")  # empty: as if unset
    assert find_config(None) == no_system_config


def test_find_config_explicit_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         no_system_config: Path) -> None:
    monkeypatch.setenv("MDIEDGE_CONFIG", str(write(tmp_path, "", "env.toml")))
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as e:
        find_config(str(missing))  # no fallback to $MDIEDGE_CONFIG
    assert str(e.value) == f"{missing}: file not found (named by --config)"


def test_find_config_env_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    no_system_config: Path) -> None:
    no_system_config.parent.mkdir()
    no_system_config.write_text("")
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("MDIEDGE_CONFIG", str(missing))
    with pytest.raises(ConfigError) as e:
        find_config(None)  # no fallback to the system file
    assert str(e.value) == f"{missing}: file not found (named by $MDIEDGE_CONFIG)"


def test_find_config_directory(tmp_path: Path, no_system_config: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        find_config(str(tmp_path))


def test_find_config_env_argument(tmp_path: Path, no_system_config: Path) -> None:
    env_file = write(tmp_path, "", "env.toml")
    assert find_config(None, env={"MDIEDGE_CONFIG": str(env_file)}) == env_file


def test_system_config_default() -> None:
    assert settings_module.SYSTEM_CONFIG == Path("/etc/mdiedge/mdiedge.toml")


# ------------------------------------------------------------------------------ secrets

SECRET = "0123456789abcdef"  # exactly 16 bytes


def secret_file(tmp_path: Path, data: bytes, mode: int = 0o600, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("data,expected", [
    (SECRET.encode() + b"\n", SECRET.encode()),
    (SECRET.encode(), SECRET.encode()),
    (SECRET.encode() + b"\r\n", SECRET.encode()),
    ("pässwörd-ünicode-✓".encode(), "pässwörd-ünicode-✓".encode()),  # printable text
])
def test_secret_file_ok(tmp_path: Path, data: bytes, expected: bytes) -> None:
    path = secret_file(tmp_path, data)
    assert read_secret(WorkerSettings(secret_file=str(path)), env={}) == expected


@pytest.mark.parametrize("data,reason", [
    (SECRET.encode() + b"\n\n", "not printable text (a control character at byte 16; "),
    (b"\x00\xff" * 8, "not printable text (not UTF-8 at byte 1; "),
    (bytes(300_000), "too large (300000 bytes; at most 4096)"),
    (b"a" * 4097, "too large (4097 bytes; at most 4096)"),
])
def test_secret_file_refused(tmp_path: Path, data: bytes, reason: str) -> None:
    """A secret file holds at most 4 KiB of printable text (issue 45, finding 9)."""
    path = secret_file(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        read_secret(WorkerSettings(secret_file=str(path), source="f.toml"), env={})
    assert str(e.value).startswith("f.toml: worker.secret_file: ")
    assert reason in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_secret_file_permissions_refused(tmp_path: Path, mode: int) -> None:
    path = secret_file(tmp_path, SECRET.encode(), mode)
    section = WorkerSettings(secret_file=str(path), source="/etc/mdiedge/mdiedge.toml")
    with pytest.raises(ConfigError) as e:
        read_secret(section, env={})
    assert str(e.value) == (f"/etc/mdiedge/mdiedge.toml: worker.secret_file: secret file "
                            f"{str(path)!r} (mode {mode:04o}) is readable by other users: "
                            f"chmod 600 {path}")


def test_secret_file_0400_ok(tmp_path: Path) -> None:
    path = secret_file(tmp_path, SECRET.encode(), 0o400)
    assert read_secret(StarterSettings(secret_file=str(path)), env={}) == SECRET.encode()


def test_secret_file_missing_and_not_regular(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^f\.toml: starter\.secret_file: secret file .* "
                                          r"not found$"):
        read_secret(StarterSettings(secret_file=str(tmp_path / "x"), source="f.toml"), env={})
    folder = tmp_path / "dir"
    folder.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_secret(StarterSettings(secret_file=str(folder), source="f.toml"), env={})


def test_secret_precedence(tmp_path: Path) -> None:
    file_a = secret_file(tmp_path, b"A" * 16, name="a")
    file_b = secret_file(tmp_path, b"B" * 16, name="b")
    env = {"MDIEDGE_SECRET": "C" * 16, "MDIEDGE_SECRET_FILE": str(file_b)}
    assert read_secret(WorkerSettings(secret="D" * 16), env) == b"D" * 16
    assert read_secret(WorkerSettings(secret_file=str(file_a)), env) == b"A" * 16
    assert read_secret(WorkerSettings(), env) == b"C" * 16
    assert read_secret(None, env) == b"C" * 16
    assert read_secret(WorkerSettings(), {"MDIEDGE_SECRET_FILE": str(file_b)}) == b"B" * 16
    assert read_secret(WorkerSettings(), {"MDIEDGE_SECRET": "", "MDIEDGE_SECRET_FILE": ""}) is None
    assert read_secret(WorkerSettings(insecure=True), {}) is None
    assert read_secret(None, {}) is None


def test_secret_from_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MDIEDGE_SECRET", "E" * 20)
    assert read_secret(StarterSettings()) == b"E" * 20


def test_secret_env_file_checked(tmp_path: Path) -> None:
    path = secret_file(tmp_path, SECRET.encode(), 0o644)
    with pytest.raises(ConfigError) as e:
        read_secret(None, {"MDIEDGE_SECRET_FILE": str(path)})
    assert str(e.value).startswith("$MDIEDGE_SECRET_FILE: ")
    assert str(e.value).endswith(f"is readable by other users: chmod 600 {path}")


@pytest.mark.parametrize("section, env, message", [
    (None, {"MDIEDGE_SECRET": "x" * 5000},
     "$MDIEDGE_SECRET: expected a secret of at most 4096 bytes, got 5000 bytes"),
    (None, {"MDIEDGE_SECRET": "0123456789\tabcdef"},
     "$MDIEDGE_SECRET: the secret is not printable text (a control character at byte 10; "),
    (WorkerSettings(secret="0123456789abcdef\x00"), {},
     "<settings>: worker.secret: the secret is not printable text (a control character at "
     "byte 16; "),
])
def test_secrets_are_printable_and_bounded(section: Any, env: Any, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        read_secret(section, env)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("where,section,env", [
    ("<settings>: worker.secret", WorkerSettings(secret="short"), {}),
    ("$MDIEDGE_SECRET", None, {"MDIEDGE_SECRET": "x" * 15}),
    ("f.toml: starter.secret_file", "file", {}),
    ("$MDIEDGE_SECRET_FILE", None, "file"),
])
def test_secret_too_short(tmp_path: Path, where: str, section: Any, env: Any) -> None:
    path = secret_file(tmp_path, b"x" * 15 + b"\n")
    if section == "file":
        section = StarterSettings(secret_file=str(path), source="f.toml")
    if env == "file":
        env = {"MDIEDGE_SECRET_FILE": str(path)}
    with pytest.raises(ConfigError) as e:
        read_secret(section, env)
    assert str(e.value) == f"{where}: expected a secret of at least 16 bytes, got " \
                           f"{5 if where.endswith('.secret') else 15} bytes"


def test_secret_from_loaded_file(tmp_path: Path) -> None:
    path = secret_file(tmp_path, SECRET.encode() + b"\n")
    s = load_settings(write(tmp_path, f'[worker]\nsecret_file = "{path}"\n'))
    assert s.worker is not None and read_secret(s.worker, {}) == SECRET.encode()


# ------------------------------------------------------------------------------ check_config


def test_check_config_summary(tmp_path: Path) -> None:
    path = secret_file(tmp_path, SECRET.encode())
    text = WORKER_FILE.replace("/etc/mdiedge/secret", str(path)) + STARTER_FILE + \
        RING_FILE.replace("[starter]\nhost = \"10.0.0.1\"\nmemory = 1000\n", "")
    config = write(tmp_path, text)
    config.chmod(0o600)  # it holds the starter's secret inline
    summary = check_config(config)
    assert "\n" not in summary
    assert summary.startswith(f"{config}: valid; ")
    for part in ("[worker] 'w1' listens on 0.0.0.0:7710", "[starter] on 10.0.0.1:7601",
                 "3 workers in the ring (w1 at 10.0.0.2:7700, jetson at 10.0.0.3:7700, "
                 "w3 at 10.0.0.3:7701)", f"secret file {path}", "secret set inline"):
        assert part in summary, summary


@pytest.mark.parametrize("text,expected", [
    ("", "holds no tables"),
    ("[worker]\ninsecure = true\n", "insecure (no secret)"),
    ('[[workers]]\nhost = "h"\ncontrol_port = 1\n', "1 worker in the ring (w1 at h:1)"),
])
def test_check_config_small(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in check_config(write(tmp_path, text), env={"MDIEDGE_SECRET": SECRET})


def test_check_config_refuses_a_ring_without_a_secret(tmp_path: Path) -> None:
    ring = write(tmp_path, '[[workers]]\nhost = "h"\ncontrol_port = 1\n')
    with pytest.raises(ConfigError, match=r"starter\.secret_file: a ring needs a secret"):
        check_config(ring, env={})
    assert "1 worker" in check_config(ring, env={"MDIEDGE_SECRET_FILE": "/s"})
    open_ring = write(tmp_path, '[starter]\ninsecure = true\n[[workers]]\nhost = "h"\n'
                                'control_port = 1\n')
    assert "insecure (no secret)" in check_config(open_ring, env={})


def test_check_config_checks_secret_files(tmp_path: Path) -> None:
    path = secret_file(tmp_path, SECRET.encode(), 0o644)
    config = write(tmp_path, f'[starter]\nsecret_file = "{path}"\n')
    with pytest.raises(ConfigError, match=r"starter\.secret_file: .*chmod 600 \S+$"):
        check_config(config)


def test_check_config_errors_like_load(tmp_path: Path) -> None:
    path = write(tmp_path, W + "threads = true\n")
    with pytest.raises(ConfigError, match=r"worker\.threads: expected an integer 0\.\.4096"):
        check_config(path)


# ------------------------------------------------------------------------------ load_ring


def test_load_ring_shape(tmp_path: Path) -> None:
    options, workers = load_ring(write(tmp_path, RING_FILE))
    assert options == {"host": "10.0.0.1", "device": "cpu", "weight": 1.0,
                       "memory": 1000, "layers": None,
                       "max_payload": defaults.MAX_PAYLOAD,
                       "prefill_chunk": defaults.PREFILL_CHUNK,
                       "timeout_s": defaults.RING_TIMEOUT_S, "stall_s": defaults.STALL_S,
                       "recover": True,
                       "rebalance_margin": defaults.REBALANCE_MARGIN, "compression": "none",
                       "quantize": "", "busy_poll_us": defaults.BUSY_POLL_US, "encrypt": True}
    assert workers == [
        NodeSpec(name="w1", host="10.0.0.2", control_port=7700, weight=2.5,
                 memory=6 * GiB, layers=(6, 14), device="cuda"),
        NodeSpec(name="jetson", host="10.0.0.3", control_port=7700),
        NodeSpec(name="w3", host="10.0.0.3", control_port=7701),
    ]
    assert workers[0].url == "http://10.0.0.2:7700"
    assert workers[0].address == "10.0.0.2:7700"


def test_load_ring_starter_options(tmp_path: Path) -> None:
    text = STARTER_FILE.replace('secret = "0123456789abcdef"\n', "") + R
    options, workers = load_ring(write(tmp_path, text))
    assert options == {"host": "10.0.0.1", "device": "cuda", "weight": 2.0,
                       "memory": 4 * GiB, "layers": (0, 6),
                       "max_payload": 64 << 20, "prefill_chunk": defaults.PREFILL_CHUNK,
                       "timeout_s": 12.5, "stall_s": defaults.STALL_S, "recover": True,
                       "rebalance_margin": defaults.REBALANCE_MARGIN, "compression": "none",
                       "quantize": "", "busy_poll_us": defaults.BUSY_POLL_US, "encrypt": True}
    options, _ = load_ring(write(tmp_path, "[starter]\ntimeout_s = 30\n" + R))
    assert (options["timeout_s"], options["max_payload"]) == (30.0, defaults.MAX_PAYLOAD)
    options, _ = load_ring(write(tmp_path, "[starter]\nprefill_chunk = 0\n" + R))
    assert options["prefill_chunk"] == 0
    with pytest.raises(ConfigError, match=r"starter\.prefill_chunk: expected an integer >= 0"):
        load_ring(write(tmp_path, "[starter]\nprefill_chunk = -8\n" + R))
    options, _ = load_ring(write(tmp_path, '[starter]\nquantize = "q4_0"\n' + R))
    assert options["quantize"] == "Q4_0"
    with pytest.raises(ConfigError, match=r"starter\.quantize: expected one of q8_0, q4_0, "
                                          r"q4_1, got 'q4_k'"):
        load_ring(write(tmp_path, '[starter]\nquantize = "q4_k"\n' + R))


def test_load_ring_without_starter_table(tmp_path: Path) -> None:
    options, workers = load_ring(write(tmp_path, W + 'name = "ignored"\n' + R))
    assert options == {"host": "127.0.0.1", "device": "cpu", "weight": 1.0,
                       "memory": None, "layers": None,
                       "max_payload": defaults.MAX_PAYLOAD,
                       "prefill_chunk": defaults.PREFILL_CHUNK,
                       "timeout_s": defaults.RING_TIMEOUT_S, "stall_s": defaults.STALL_S,
                       "recover": True,
                       "rebalance_margin": defaults.REBALANCE_MARGIN, "compression": "none",
                       "quantize": "", "busy_poll_us": defaults.BUSY_POLL_US, "encrypt": True}
    assert [w.name for w in workers] == ["w1"]


def test_load_ring_starter_compression(tmp_path: Path) -> None:
    from mdiedge.base.nodes import StarterOptions

    options, workers = load_ring(write(tmp_path, S + 'compression = "int8:fp16"\n' + R
                                       + 'compression = "fp16"\n'))
    assert options["compression"] == "int8:fp16"
    assert StarterOptions(**options).compression == "int8:fp16"
    assert workers[0].compression == "fp16"  # a worker's own still names its link's


@pytest.mark.parametrize("value,shown", [('"int4"', "'int4'"), ("8", "8"), ('"fp16:"', "'fp16:'"),
                                         ('"INT8"', "'INT8'")])
def test_a_bad_starter_compression_is_one_line(tmp_path: Path, value: str, shown: str) -> None:
    path = write(tmp_path, S + f"compression = {value}\n" + R)
    with pytest.raises(ConfigError) as e:
        load_ring(path)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: starter.compression: expected one of none, fp16, int8")
    assert message.endswith(f"got {shown}")


def test_the_starter_skeletons_explain_compression() -> None:
    from mdiedge.serving.skeletons import skeleton

    for kind in ("starter", "ring"):
        text = skeleton(kind)
        assert '# compression = "none"' in text.split("\n[[workers]]")[0]
        loaded = tomllib_loads(text.replace('# compression = "none"', 'compression = "int8"'))
        assert loaded["starter"]["compression"] == "int8"


def tomllib_loads(text: str) -> Dict[str, Any]:
    from mdiedge.base.settings import tomllib

    return tomllib.loads(text)


def test_load_ring_options_are_starter_options(tmp_path: Path) -> None:
    from mdiedge.base.nodes import StarterOptions

    options, _ = load_ring(write(tmp_path, STARTER_FILE + R))
    assert StarterOptions(**options).weight == 2.0  # every key is a field


def test_config_check_refuses_two_entries_for_one_worker(tmp_path: Path) -> None:
    config = write(tmp_path, '[[workers]]\nhost = "localhost"\ncontrol_port = 7700\n'
                             '[[workers]]\nhost = "127.0.0.1"\ncontrol_port = 7700\n')
    with pytest.raises(ConfigError) as e:
        check_config(config, env={"MDIEDGE_SECRET": SECRET})
    assert str(e.value) == (f"{config}: workers[1].host: 127.0.0.1:7700 and workers[0]'s "
                            f"localhost:7700 are one worker (127.0.0.1:7700): every worker "
                            f"needs its own address")
    other_port = write(tmp_path, '[[workers]]\nhost = "localhost"\ncontrol_port = 7700\n'
                                 '[[workers]]\nhost = "127.0.0.1"\ncontrol_port = 7710\n')
    assert "2 workers in the ring" in check_config(other_port, env={"MDIEDGE_SECRET": SECRET})


@pytest.mark.parametrize("table", ["worker", "starter"])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_an_inline_secret_in_a_file_others_may_read_is_refused(tmp_path: Path, table: str,
                                                               mode: int) -> None:
    config = write(tmp_path, f'[{table}]\nsecret = "inline-secret-0123456"\n')
    config.chmod(mode)
    settings = load_settings(config)
    section = settings.worker if table == "worker" else settings.starter
    message = (f"{config}: {table}.secret is set inline, but the file (mode {mode:04o}) is "
               f"readable by other users: chmod 600 {config}, or move the secret to a "
               f"secret_file")
    for check in (lambda: read_secret(section, {}), lambda: check_config(config)):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == message
    config.chmod(0o600)
    assert read_secret(section, {}) == b"inline-secret-0123456"
    assert "secret set inline" in check_config(config)


def test_load_ring_secret_from_the_starter_table_else_the_environment(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-secret-file-0123\n")
    secret_file.chmod(0o600)
    env = {"MDIEDGE_SECRET": "from-the-environment-0123"}
    private = write(tmp_path, S + 'secret = "inline-secret-0123456"\n' + R)
    private.chmod(0o600)
    inline, _ = load_ring(private, secret=True, env=env)
    assert inline["secret"] == b"inline-secret-0123456"
    in_file, _ = load_ring(write(tmp_path, S + f'secret_file = "{secret_file}"\n' + R),
                           secret=True, env=env)
    assert in_file["secret"] == b"from-the-secret-file-0123"
    from_env, _ = load_ring(write(tmp_path, R), secret=True, env=env)
    assert from_env["secret"] == b"from-the-environment-0123"
    none, _ = load_ring(write(tmp_path, S + R), secret=True, env={})
    assert none["secret"] is None
    assert "secret" not in load_ring(write(tmp_path, R))[0]  # only when asked


@pytest.mark.parametrize("text", ["", "[starter]\n", "workers = []\n"])
def test_load_ring_needs_workers(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_ring(path)
    assert str(e.value) == (f"{path}: workers: a ring file needs at least one [[workers]] "
                            f"entry, got none")


def test_load_ring_errors(tmp_path: Path) -> None:
    path = write(tmp_path, S + "wieght = 2\n" + R)
    with pytest.raises(ConfigError, match=r": starter\.wieght: unknown key \(did you mean "
                                          r"'weight'\?\)$"):
        load_ring(path)
    with pytest.raises(ConfigError, match=r"file not found$"):
        load_ring(tmp_path / "missing.toml")


# ------------------------------------------------------------------------------ fuzzing

KEYS = sorted(set(WORKER_SCHEMA) | set(STARTER_SCHEMA) | set(WORKERS_SCHEMA)) + [
    "worker", "starter", "workers", "x"]


def toml_string(text: str) -> str:
    out = []
    for c in text:
        if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F:
            out.append("\\u%04x" % ord(c))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def dump(document: Dict[str, Any]) -> str:
    """A TOML document: top-level keys as ``key = value`` lines, tables inline."""
    return "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in document.items())


scalars = st.one_of(
    st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1), st.integers(-2, 70000),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["4GiB", "64MiB", "1.5 kb", "cpu", "cuda:0", "cuda", "float32", "bf16",
                     "info", "debug", "127.0.0.1", "0123456789abcdef", "/tmp", ""]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)),
    max_leaves=12)
tables = st.dictionaries(st.sampled_from(KEYS), values, max_size=8)
paths = st.sampled_from(["/tmp", "", "~/x", "rel/dir"])
numbers = st.integers(-1, 100) | st.floats(-1, 100) | st.sampled_from([math.inf, math.nan])
sizes = st.integers(-1, 10 ** 12) | st.sampled_from(["4GiB", "1 kb", "0", "0.5b", "2 TB", "x"])
ports = st.integers(-1, 70000) | st.sampled_from([0, 7700, 7701])
PLAUSIBLE = {  # values near and on both sides of each key's rule
    "name": st.sampled_from(["w1", "w2", "w3", "a", ""]),
    "host": st.sampled_from(["h", "10.0.0.2", "a b", ""]),
    "control_port": ports, "data_port": ports, "threads": st.integers(-1, 8),
    "cache_dir": paths, "model": paths, "tokenizer": paths, "secret_file": paths,
    "log_level": st.sampled_from(["debug", "info", "warning", "error", "INFO"]),
    "idle_timeout_s": numbers, "timeout_s": numbers, "weight": numbers,
    "secret": st.sampled_from(["0123456789abcdef", "short"]), "insecure": st.booleans(),
    "layers": st.lists(st.integers(-1, 30), max_size=3),
    "device": st.sampled_from(["cpu", "cuda", "cuda:0", "gpu"]),
    "dtype": st.sampled_from(["float32", "bf16", "float64"]),
    "memory": sizes, "max_payload": sizes, "stall_s": numbers, "rebalance_margin": numbers,
    "recover": st.booleans(), "encrypt": st.booleans(), "spare": st.booleans(), "prefill_chunk": st.integers(-1, 600),
    "compression": st.sampled_from(["none", "int8", "int8:fp16", "int4", "fp16:"]),
    "quantize": st.sampled_from(["q8_0", "Q4_1", "q4_k", "", "f16"]),
    "busy_poll_us": st.integers(-1, 3) | st.sampled_from([200, 100_000, 100_001]),
    "cpu_dot": st.sampled_from(["q8", "f32", "Q8", "int8", ""]),
}


def section(schema: Dict[str, Any]) -> Any:
    """Tables that mostly follow ``schema``, so that values, not keys, are what fails."""
    return st.fixed_dictionaries({}, optional={
        key: PLAUSIBLE[key] | scalars if key != "host" else PLAUSIBLE[key] for key in schema})


documents = st.fixed_dictionaries({}, optional={
    "worker": section(WORKER_SCHEMA) | tables, "starter": section(STARTER_SCHEMA) | tables,
    "workers": st.lists(section(WORKERS_SCHEMA), max_size=4) | st.lists(tables, max_size=4)
    | values,
}) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), values, max_size=4)

LINES = ["[worker]", "[starter]", "[[workers]]", "[worker", "[[workers]", "]", "[", "=",
         'host = "h"', "control_port = 7700", "control_port = true", "layers = [1, 2]",
         'memory = "4GiB"', "name = ", 'name = "a"', "x = {", "a.b.c = 1", "layers = [[[[1]]]]",
         '"""', "'''", "#", "secret = '0123456789abcdef'", "workers = []", "worker = 1"]
tomlish = st.lists(st.sampled_from(LINES) | st.text(max_size=15), max_size=12).map("\n".join)


@pytest.fixture(scope="module")
def fuzz_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


def only_config_errors(path: Path, data: bytes) -> Optional[Settings]:
    path.write_bytes(data)
    try:
        result = load_settings(path)
        summary = check_config(path)  # also checks secret files, which loading leaves alone
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and "\r" not in message, message
        assert message.startswith(f"{path}: "), message
        return None
    assert isinstance(result, Settings)
    assert summary.startswith(f"{path}: valid")
    return result


FUZZ = hsettings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


@FUZZ
@given(text=tomlish)
def test_fuzz_tomlish_text(fuzz_dir: Path, text: str) -> None:
    only_config_errors(fuzz_dir / "text.toml", text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(data=st.binary(max_size=64))
def test_fuzz_bytes(fuzz_dir: Path, data: bytes) -> None:
    only_config_errors(fuzz_dir / "bytes.toml", data)


@FUZZ
@given(document=documents)
def test_fuzz_documents(fuzz_dir: Path, document: Dict[str, Any]) -> None:
    text = dump(document)
    path = fuzz_dir / "doc.toml"
    result = only_config_errors(path, text.encode())
    from mdiedge.base.settings import tomllib

    assert tomllib.loads(text) == document or any(
        isinstance(v, float) and math.isnan(v) for v in _leaves(document))
    if result is not None:  # everything that loads satisfies the schema's promises
        for section in (result.worker, result.starter):
            if section is not None and section.layers is not None:
                assert 0 <= section.layers[0] < section.layers[1]
        names = [w.name for w in result.workers]
        assert len(names) == len(set(names))


def _leaves(value: Any) -> List[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


@FUZZ
@given(table=tables, which=st.sampled_from(["worker", "starter"]))
def test_fuzz_one_table(fuzz_dir: Path, table: Dict[str, Any], which: str) -> None:
    only_config_errors(fuzz_dir / "table.toml", dump({which: table}).encode())


def test_fuzz_dump_roundtrip() -> None:
    from mdiedge.base.settings import tomllib

    doc = {"worker": {"name": 'a"b\\c\n\x7f', "layers": [1, 2], "x": {"y": 1.5}}}
    assert tomllib.loads(dump(doc)) == doc


def test_check_config_unreadable_secret_file(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``config check`` run by a user who may not read a root-only secret file says so."""
    path = secret_file(tmp_path, SECRET.encode(), 0o600)
    config = write(tmp_path, f'[worker]\nsecret_file = "{path}"\n')
    from mdiedge.base import settings

    read = settings.read_small_file

    def fake_read(file: Path, *args: Any, **kwargs: Any) -> bytes:
        if file == path:
            raise PermissionError(13, "Permission denied", str(file))
        return read(file, *args, **kwargs)

    monkeypatch.setattr(settings, "read_small_file", fake_read)
    assert "not readable by this user, unchecked" in check_config(config)
    with pytest.raises(ConfigError, match=r"worker\.secret_file: cannot read secret file .*"
                                          r"Permission denied$"):
        read_secret(load_settings(config).worker, {})
