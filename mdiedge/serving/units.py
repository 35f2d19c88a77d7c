"""systemd units for mdiedge nodes, and their installation (``mdiedge install-units``).

The unit files in the checkout's ``systemd/`` folder are the source (an installed package ships
them as ``mdiedge/_systemd``). :func:`render_unit` returns one with ``ExecStart=`` running a
given ``mdiedge`` (by default this install's, :func:`default_command`) and the configs and the
secret in a given folder; :func:`install_units` writes all three into a unit folder plus a
commented config skeleton for the worker and the starter (configs are never overwritten, units
only with ``force``). As root: ``sudo "$(command -v mdiedge)" install-units``, then
``systemctl daemon-reload``.

The units run mdiedge as a dynamic user: the executable and its Python environment must be
readable by any user (a virtual environment under a 0700 home folder is not). They need
systemd >= 240 (the worker's ``$STATE_DIRECTORY``; the starter's unit 236, for
``StandardInput=file:``, which hands the root-only secret file to the node).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..base.defaults import (BUSY_POLL_US, IDLE_TIMEOUT_S, MAX_PAYLOAD, PREFILL_CHUNK,
                             REBALANCE_MARGIN, RING_TIMEOUT_S, STALL_S, STARTER_CONTROL_PORT,
                             WORKER_CONTROL_PORT, WORKER_DATA_PORT)
from ..base.dtypes import TABLE as DTYPE_TABLE
from ..base.errors import ConfigError

UNIT_NAMES = ("mdiedge-worker.service", "mdiedge-worker@.service", "mdiedge-starter.service")
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
DEFAULT_CONFIG_DIR = Path("/etc/mdiedge")
SOURCE_EXECUTABLE = "/usr/local/bin/mdiedge"  # what the unit files in systemd/ name


def _one_of(words: Sequence[str]) -> str:
    """``"a", "b" or "c"``."""
    quoted = [f'"{word}"' for word in words]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


# The skeletons' values are the defaults of mdiedge.base.defaults and mdiedge.base.dtypes.
WORKER_CONFIG = f"""\
# mdiedge worker config (/etc/mdiedge/mdiedge.toml), read by mdiedge-worker.service.
# mdiedge-worker@NAME.service reads /etc/mdiedge/worker-NAME.toml instead: copy this file and
# give every worker on the board its own name and ports.
# Anyone on the board can read this file: keep the ring secret out of it (see secret_file).

[worker]
# Name shown in logs and in the starter's status.
name = "w1"
# Listen address of both the control and the data port; "0.0.0.0" = every interface.
host = "0.0.0.0"
# HTTP control port: the starter's [[workers]] entry for this board names it.
control_port = {WORKER_CONTROL_PORT}
# Data-plane port: hidden states of the ring travel here (the starter learns it on the
# control port).
data_port = {WORKER_DATA_PORT}
# torch threads; 0 = torch's default (one per core).
threads = 0
# Where received weights are cached (by content hash). The shipped units pass
# --cache-dir $STATE_DIRECTORY (/var/lib/mdiedge), which wins over this.
cache_dir = "/var/lib/mdiedge"
# debug, info, warning or error (logs go to the journal).
log_level = "info"
# Free the KV-cache slots when the starter has been silent this many seconds.
idle_timeout_s = {IDLE_TIMEOUT_S:g}
# Microseconds a wait for the next activation polls the data link before it sleeps: a
# message that comes sooner saves the wake-up from sleep (tens of µs a hop) at the price of
# that much CPU. 0: sleep at once (the least power).
busy_poll_us = {BUSY_POLL_US}
# false: the data links go unsealed, as with --no-encrypt (every node of a ring must agree,
# or the link set-up fails): for measuring the cost of sealing only. Activations then travel
# in plaintext and unauthenticated after the handshake.
encrypt = true
# File holding the ring secret (one line). Leave it unset under the shipped units: systemd
# opens /etc/mdiedge/secret (mode 0600, root) as the worker's standard input and the worker
# reads it there (--secret-fd 0, which wins); the unit's dynamic user cannot read the file.
# secret_file = "/etc/mdiedge/secret"
# The ring secret itself, at least 16 bytes, instead of secret_file (then make this file
# unreadable to others). Neither set: $MDIEDGE_SECRET, else $MDIEDGE_SECRET_FILE.
# secret = "put the output of: openssl rand -hex 32"
# true: listen on a non-loopback address without a secret (anyone who reaches the ports can
# drive the node). Only for isolated test networks.
insecure = false
# Optional: a model to load before telling systemd READY=1 (a folder under /var/lib/mdiedge,
# readable by the service), so a starter assigning the same blocks finds them ready.
# model = "/var/lib/mdiedge/models/tinyllama"
# Only with model: the block range [first, end) of it to load (default: every block).
# layers = [10, 22]
# Only with model: the device of the loaded blocks, "cpu" or "cuda".
# device = "cpu"
# Only with model: the dtype of the loaded blocks,
# {_one_of([d.name for d in DTYPE_TABLE if d.compute])}.
# dtype = "float32"
"""

STARTER_CONFIG = f"""\
# mdiedge starter config (/etc/mdiedge/starter.toml), read by mdiedge-starter.service.
# Anyone on the board can read this file: keep the ring secret out of it (see secret_file).

[starter]
# Listen address of the starter's control port; "0.0.0.0" = every interface.
host = "0.0.0.0"
# HTTP control port of the starter (generation requests, ring status).
control_port = {STARTER_CONTROL_PORT}
# The model the ring runs: a folder readable by the service (put it under /var/lib/mdiedge,
# the unit's state directory).
model = "/var/lib/mdiedge/models/tinyllama"
# Optional: a tokenizer file, if not the model's own (tokenizer.model or tokenizer.json).
# tokenizer = "/var/lib/mdiedge/models/tinyllama/tokenizer.model"
# Device of the starter's own share of the layers: "cpu" or "cuda".
device = "cpu"
# Weight dtype on the ring: {_one_of([d.name for d in DTYPE_TABLE if d.compute])}.
dtype = "float32"
# Relative speed of this board: layers are split in proportion to the weights.
weight = 1.0
# Optional: cap the memory the starter's share may use ("4GiB", "512MiB", ...).
# memory = "4GiB"
# Optional: pin the starter to this block range [first, end) instead of the automatic split.
# layers = [0, 6]
# Largest tensor payload of one data-plane frame; a larger frame closes the link.
# max_payload = "{MAX_PAYLOAD >> 20}MiB"
# Prompt tokens per prefill message, so that the nodes work on chunks of a long prompt in
# parallel and a chunk travels while the next is computed (0: the whole prompt at once).
# prefill_chunk = {PREFILL_CHUNK}
# A message not back around the ring within this many seconds is a failure, and the node
# that froze is named.
# timeout_s = {RING_TIMEOUT_S:g}
# A worker that returns no message for this many seconds, and then does not answer on its
# control port within it either, is lost: its layers move to a spare or to the survivors.
stall_s = {STALL_S:g}
# false: a lost node fails the requests in flight instead of the ring recovering without it.
recover = true
# Between requests, re-split the layers when the slowest node's measured time per block is
# this fraction above the mean (0: never).
rebalance_margin = {REBALANCE_MARGIN:g}
# Optional: codecs of every link whose [[workers]] entry names none: none, fp16, int8, or
# PREFILL:DECODE such as int8:fp16 (--compression on the command line wins).
# compression = "none"
# Optional: quantize the blocks' float weights on load to q8_0, q4_0 or q4_1 (CPU, float32
# arithmetic; a GGUF file's blocks are kept as they are; --quantize on the command line wins).
# quantize = "q8_0"
# Microseconds a wait for the last worker's message polls the link before it sleeps: a
# message that comes sooner saves the wake-up from sleep at the price of that much CPU.
# 0: sleep at once (the least power).
busy_poll_us = {BUSY_POLL_US}
# false: the data links go unsealed, as with --no-encrypt (every node of a ring must agree,
# or the link set-up fails): for measuring the cost of sealing only. Activations then travel
# in plaintext and unauthenticated after the handshake.
encrypt = true
# File holding the ring secret (one line). Leave it unset under the shipped unit: systemd
# opens /etc/mdiedge/secret (mode 0600, root) as the starter's standard input and the starter
# reads it there (--secret-fd 0, which wins); the unit's dynamic user cannot read the file.
# secret_file = "/etc/mdiedge/secret"
# The ring secret itself, at least 16 bytes, instead of secret_file (then make this file
# unreadable to others). Neither set: $MDIEDGE_SECRET, else $MDIEDGE_SECRET_FILE.
# secret = "put the output of: openssl rand -hex 32"
# true: listen on a non-loopback address without a secret (anyone who reaches the port can
# drive the ring). Only for isolated test networks.
# insecure = false

# One [[workers]] table per worker, in ring order.
[[workers]]
# The worker's name (as in its own config).
name = "w1"
# Address the starter reaches the worker at.
host = "10.0.0.2"
# The worker's control_port.
control_port = {WORKER_CONTROL_PORT}
# Device the worker runs its layers on: "cpu" or "cuda".
device = "cuda"
# Relative speed of the worker: layers are split in proportion to the weights.
weight = 1.0
# Optional: cap the memory the worker's share may use.
# memory = "6GiB"
# Optional: pin the worker to this block range [first, end).
# layers = [6, 14]
# true: a spare, given no layers until a worker is lost; it then takes that worker's place.
spare = false
# Optional: codecs of the link into this worker: none, fp16, int8, or PREFILL:DECODE such as int8:fp16 (default: the starter's --compression).
# compression = "int8"
"""

CONFIGS = {"mdiedge.toml": WORKER_CONFIG, "starter.toml": STARTER_CONFIG}
SKELETONS = {"worker": WORKER_CONFIG, "starter": STARTER_CONFIG,
             "ring": STARTER_CONFIG.replace(
                 "# mdiedge starter config (/etc/mdiedge/starter.toml), read by "
                 "mdiedge-starter.service.",
                 "# mdiedge ring file, for `mdiedge generate --ring FILE` and `mdiedge status "
                 "--ring FILE`.", 1)}


def skeleton(kind: str) -> str:
    """The commented config skeleton of ``kind`` (worker, starter or ring)."""
    try:
        return SKELETONS[kind]
    except KeyError:
        raise ConfigError(f"unknown config kind {kind!r}; choose worker, starter or ring") from None

_EXEC_START = re.compile(r"^(ExecStart=[-@:+!]*)(\S+)(.*)$", re.MULTILINE)
_CONFIGURATION_DIRECTORY = re.compile(r"^ConfigurationDirectory=.*\n", re.MULTILINE)


def unit_source_dir() -> Path:
    """The folder holding the unit files: the installed copy, else the checkout's ``systemd/``."""
    here = Path(__file__).resolve().parent.parent  # the mdiedge package
    candidates = (here / "_systemd", here.parent / "systemd")
    for folder in candidates:
        if all((folder / name).is_file() for name in UNIT_NAMES):
            return folder
    raise FileNotFoundError(
        "mdiedge's systemd unit files are missing (looked in %s)"
        % ", ".join(str(c) for c in candidates))


def _quote_exec(path: str) -> str:
    """``path`` as the first word of an ``ExecStart=`` line: specifiers escaped, quoted when
    it holds whitespace, quotes or backslashes."""
    if "$" in path or any(c in path for c in "\n\r\0"):
        # systemd does not unescape "$$" in the executable's path
        raise ConfigError(f"cannot put {path!r} on an ExecStart= line")
    word = path.replace("%", "%%")
    if re.search(r'[\s"\'\\]', word):
        word = '"%s"' % word.replace("\\", "\\\\").replace('"', '\\"')
    return word


def _config_folder(config_dir: "os.PathLike[str] | str") -> str:
    """``config_dir`` as the units name it: an absolute path that needs no quoting or escaping
    in any directive (``--config``, ``StandardInput=file:``)."""
    folder = os.path.normpath(str(config_dir))
    if not os.path.isabs(folder):
        raise ConfigError(f"the config folder must be an absolute path, not {str(config_dir)!r}")
    if re.search(r'[\s"\'\\$%;]', folder):
        raise ConfigError(f"the units cannot name the config folder {folder!r}: choose one "
                          f"without whitespace, quotes, backslashes, '$', '%' or ';'")
    return folder


def carry_config_dir(text: str, config_dir: "os.PathLike[str] | str") -> str:
    """``text`` (a unit or a config skeleton) naming ``config_dir`` wherever it names
    /etc/mdiedge: the configs, the secret and ``ConfigurationDirectory=`` (dropped for a folder
    outside /etc, which that directive cannot name)."""
    folder = _config_folder(config_dir)
    text = text.replace(f"{DEFAULT_CONFIG_DIR}/", f"{folder}/")
    if folder.startswith("/etc/"):
        return _CONFIGURATION_DIRECTORY.sub(
            f"ConfigurationDirectory={folder[len('/etc/'):]}\n", text)
    return _CONFIGURATION_DIRECTORY.sub("", text)


def render_unit(name: str, executable: str,
                config_dir: "os.PathLike[str] | str" = DEFAULT_CONFIG_DIR,
                args: Sequence[str] = ()) -> str:
    """The unit file ``name`` (one of :data:`UNIT_NAMES`) with ``ExecStart=`` running
    ``executable`` (an absolute path) and ``args`` before the subcommand (``-m mdiedge`` when
    ``executable`` is a Python), its configs and secret in ``config_dir``."""
    if name not in UNIT_NAMES:
        raise ConfigError(f"unknown unit {name!r} (known: {', '.join(UNIT_NAMES)})")
    if not os.path.isabs(executable):
        raise ConfigError(f"ExecStart= needs an absolute path, not {executable!r}")
    text = carry_config_dir((unit_source_dir() / name).read_text(encoding="utf-8"), config_dir)
    exec_words = " ".join([_quote_exec(executable)] + [_quote_exec(a) for a in args])
    rendered, count = _EXEC_START.subn(
        lambda m: m.group(1) + exec_words + m.group(3), text)
    if count != 1:
        raise ValueError(f"{name}: expected one ExecStart= line, found {count}")
    return rendered


def default_command(python: str = sys.executable) -> Tuple[str, ...]:
    """How the units run this install of mdiedge: the console script beside ``python`` (the
    interpreter running now, e.g. a virtual environment's), else ``python -m mdiedge``, after
    checking that ``python`` imports mdiedge with neither $PYTHONPATH nor a user site (which a
    unit does not have)."""
    if not python or not os.path.isabs(python):
        raise ConfigError(f"cannot tell this Python's path (sys.executable is {python!r}): "
                          f"pass the mdiedge executable")
    script = Path(python).parent / "mdiedge"
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    probe = subprocess.run([python, "-I", "-c", "import mdiedge"], cwd="/", timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        raise ConfigError(f"{python} finds mdiedge only through $PYTHONPATH or a user site, "
                          f"which a unit does not have: install mdiedge into it (pip install "
                          f"...) or pass the mdiedge executable")
    return (python, "-m", "mdiedge")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except PermissionError as e:
        raise PermissionError(e.errno, e.strerror, str(path.parent)) from None


def _on_disk(root: Optional[Path], path: Path) -> Path:
    """Where ``path`` (as the installed system sees it) is written: under ``root`` if given."""
    return path if root is None else Path(root) / path.relative_to(path.anchor)


def _write_new(folder: Path, files: Sequence[Tuple[str, str]], replace: bool) -> List[Path]:
    """Write ``files`` (name, text) into ``folder``, skipping those that exist unless
    ``replace``; the files written."""
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    written = []
    for name, text in files:
        target = folder / name
        if target.exists() and not replace:
            continue
        _write(target, text)
        written.append(target)
    return written


def install_units(dest: "os.PathLike[str] | str" = DEFAULT_UNIT_DIR,
                  executable: Optional[str] = None,
                  config_dir: "os.PathLike[str] | str" = DEFAULT_CONFIG_DIR,
                  force: bool = False, root: "os.PathLike[str] | str | None" = None
                  ) -> List[Path]:
    """Write the three units into ``dest`` (ExecStart= running ``executable``, by default
    :func:`default_command`) and the config skeletons ``mdiedge.toml`` and ``starter.toml``
    into ``config_dir``; the units and skeletons name the configs and the secret there.

    ``root``: write everything under this folder (an image being built, a test), the paths
    in the files still as the installed system sees them. Relative folders are taken from
    the current one (only without ``root``). Existing configs are never touched; existing
    units are replaced only with ``force``. Returns the files written. Run ``systemctl
    daemon-reload`` afterwards.
    """
    command = default_command() if executable is None else (executable,)
    base = None if root is None else Path(root)
    dest, config_dir = Path(dest), Path(config_dir)
    if base is None:
        dest, config_dir = Path(os.path.abspath(dest)), Path(os.path.abspath(config_dir))
    units = [(name, render_unit(name, command[0], config_dir, command[1:]))
             for name in UNIT_NAMES]
    if not dest.is_absolute():
        raise ConfigError(f"the unit folder must be an absolute path, not {str(dest)!r}")
    configs = [(name, carry_config_dir(text, config_dir)) for name, text in CONFIGS.items()]
    return (_write_new(_on_disk(base, dest), units, force)
            + _write_new(_on_disk(base, config_dir), configs, False))


if __name__ == "__main__":
    sys.exit('mdiedge: error: the installer is `mdiedge install-units` (as root: '
             'sudo "$(command -v mdiedge)" install-units)')
