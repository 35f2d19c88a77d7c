"""systemd units for mdiedge nodes, and their installation.

The unit files in the checkout's ``systemd/`` folder are the source (an installed package ships
them as ``mdiedge/_systemd``). :func:`render_unit` returns one with ``ExecStart=`` pointing at a
given ``mdiedge`` executable; :func:`install_units` writes all three into a unit folder plus a
commented config skeleton for the worker and the starter (configs are never overwritten, units
only with ``force``). As root: ``python3 -m mdiedge.ops.units [--force]``, then
``systemctl daemon-reload``.

The units run mdiedge as a dynamic user: the executable and its Python environment must be
readable by any user (a virtual environment under a 0700 home folder is not).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

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
# File holding the ring secret (one line). Leave it unset under the shipped units: systemd
# hands /etc/mdiedge/secret (mode 0600, root) to the worker as a credential and names it in
# $MDIEDGE_SECRET_FILE; the unit's dynamic user cannot read the root-only file itself.
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
# Microseconds a wait for the last worker's message polls the link before it sleeps: a
# message that comes sooner saves the wake-up from sleep at the price of that much CPU.
# 0: sleep at once (the least power).
busy_poll_us = {BUSY_POLL_US}
# File holding the ring secret (one line). Leave it unset under the shipped unit: systemd
# hands /etc/mdiedge/secret (mode 0600, root) to the starter as a credential and names it in
# $MDIEDGE_SECRET_FILE; the unit's dynamic user cannot read the root-only file itself.
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
        raise ValueError(f"cannot put {path!r} on an ExecStart= line")
    word = path.replace("%", "%%")
    if re.search(r'[\s"\'\\]', word):
        word = '"%s"' % word.replace("\\", "\\\\").replace('"', '\\"')
    return word


def render_unit(name: str, executable: str) -> str:
    """The unit file ``name`` (one of :data:`UNIT_NAMES`) with ``ExecStart=`` running
    ``executable`` (an absolute path)."""
    if name not in UNIT_NAMES:
        raise ValueError(f"unknown unit {name!r} (known: {', '.join(UNIT_NAMES)})")
    if not os.path.isabs(executable):
        raise ValueError(f"ExecStart= needs an absolute path, not {executable!r}")
    text = (unit_source_dir() / name).read_text(encoding="utf-8")
    exec_word = _quote_exec(executable)
    rendered, count = _EXEC_START.subn(
        lambda m: m.group(1) + exec_word + m.group(3), text)
    if count != 1:
        raise ValueError(f"{name}: expected one ExecStart= line, found {count}")
    return rendered


def default_executable() -> str:
    """The ``mdiedge`` console script: on ``$PATH``, else beside this Python, else argv[0]."""
    found = shutil.which("mdiedge")
    if found:
        return os.path.abspath(found)
    sibling = Path(sys.executable).parent / "mdiedge"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    return str(Path(sys.argv[0]).resolve())


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def install_units(dest: Path = DEFAULT_UNIT_DIR, executable: Optional[str] = None,
                  config_dir: Path = DEFAULT_CONFIG_DIR, force: bool = False) -> List[Path]:
    """Write the three units into ``dest`` (ExecStart= running ``executable``) and the config
    skeletons ``mdiedge.toml`` and ``starter.toml`` into ``config_dir``.

    Existing configs are never touched; existing units are replaced only with ``force``.
    Returns the files written. Run ``systemctl daemon-reload`` afterwards.
    """
    if executable is None:
        executable = default_executable()
        if not (os.path.isfile(executable) and os.access(executable, os.X_OK)):
            raise FileNotFoundError(
                f"no mdiedge executable found (tried {executable}); pass executable=")
    rendered = [(name, render_unit(name, executable)) for name in UNIT_NAMES]
    written: List[Path] = []
    dest, config_dir = Path(dest), Path(config_dir)
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in rendered:
        target = dest / name
        if target.exists() and not force:
            continue
        _write(target, text)
        written.append(target)
    config_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    for name, text in CONFIGS.items():
        target = config_dir / name
        if target.exists():
            continue
        _write(target, text)
        written.append(target)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mdiedge.ops.units",
        description="Install mdiedge's systemd units and config skeletons.")
    parser.add_argument("--dest", type=Path, default=DEFAULT_UNIT_DIR,
                        help="unit folder (default: %(default)s)")
    parser.add_argument("--executable", default=None,
                        help="absolute path of mdiedge (default: the one on $PATH)")
    parser.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR,
                        help="config folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace existing unit files")
    args = parser.parse_args(argv)
    try:
        written = install_units(args.dest, args.executable, args.config_dir, args.force)
    except (OSError, ValueError) as e:
        print(f"mdiedge.ops.units: error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("nothing to do (units exist: --force replaces them; configs are never replaced)")
    else:
        print("next: systemctl daemon-reload")
    return 0


if __name__ == "__main__":
    sys.exit(main())
