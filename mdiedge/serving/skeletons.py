"""The commented config skeletons (``mdiedge config init``, and ``install-units``' configs): every
key, its meaning, its default. As written they run on one machine (loopback, workers ``w1`` and
``w2`` on ports of their own, the shipped model, the user's secret file and cache); a value that
differs on a ring of boards is a comment below its key."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..base.defaults import (BUSY_POLL_US, IDLE_TIMEOUT_S, MAX_PAYLOAD, PREFILL_CHUNK,
                             REBALANCE_MARGIN, RING_TIMEOUT_S, STALL_S, STARTER_CONTROL_PORT,
                             WORKER_CONTROL_PORT, WORKER_DATA_PORT)
from ..base.dtypes import TABLE as DTYPE_TABLE
from ..base.errors import UsageError
from ..base.settings import check_private

KINDS = ("worker", "starter", "ring")
RING_WORKERS = 2  # the workers the starter's and the ring's skeletons name
BOARD_SECRET = "/etc/mdiedge/secret"  # the file the shipped units hand a node
BOARD_CACHE = "/var/lib/mdiedge"  # the units' state directory
_WORKER_NAME = re.compile(r"w([1-9][0-9]*)")
MAX_WORKER_INDEX = (65535 - WORKER_DATA_PORT) // 2 + 1


def _one_of(words: List[str]) -> str:
    quoted = [f'"{word}"' for word in words]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


_DTYPES = _one_of([d.name for d in DTYPE_TABLE if d.compute])


def worker_ports(name: str) -> Tuple[int, int]:
    """``wN`` takes the N-th pair from 7700/7701 (w2: 7702/7703), any other name the first."""
    found = _WORKER_NAME.fullmatch(name)
    index = int(found.group(1)) if found else 1
    if index > MAX_WORKER_INDEX:
        raise UsageError(f"--name: expected w1..w{MAX_WORKER_INDEX} or another name, got "
                         f"{name!r}")
    return WORKER_CONTROL_PORT + 2 * (index - 1), WORKER_DATA_PORT + 2 * (index - 1)


def _toml(text: str) -> str:
    """A TOML basic string (a path with a quote or backslash included)."""
    return json.dumps(text, ensure_ascii=False)


def _worker(name: str, secret_file: str, cache_dir: str) -> str:
    control, data = worker_ports(name)
    return f"""\
# mdiedge worker config: `mdiedge worker --config FILE` (mdiedge-worker.service reads
# /etc/mdiedge/mdiedge.toml, mdiedge-worker@NAME.service /etc/mdiedge/worker-NAME.toml).
# As written it runs on this machine, as worker {name} of the starter's and the ring's
# skeletons; a commented line below a key is its value on a ring of boards.

[worker]
# Name shown in logs and in the starter's status (`config init worker --name w2`: the
# second worker, on the next two ports).
name = "{name}"
# Listen address of both the control and the data port: loopback reaches this machine only.
# On a board: "0.0.0.0" (every interface) or the board's own address.
host = "127.0.0.1"
# host = "0.0.0.0"
# HTTP control port: the starter's [[workers]] entry for this worker names it.
control_port = {control}
# Data-plane port: hidden states of the ring travel here (the starter learns it on the
# control port).
data_port = {data}
# Compute threads (--threads on the command line wins); 0 = every core this process may
# use (its CPU affinity, within a cgroup's cpu.max).
threads = 0
# How this node's CPU kernels multiply quantized weights (--cpu-dot wins): "q8" (8-bit
# activations, integer dot products, as llama.cpp does) or "f32" (float32, exact); unset:
# $MDIEDGE_CPU_DOT, else q8. A GPU ignores it.
# cpu_dot = "q8"
# Where received weights are cached (by content hash): a folder this user can write. The
# shipped units pass --cache-dir $STATE_DIRECTORY ({BOARD_CACHE}), which wins over this.
cache_dir = {_toml(cache_dir)}
# cache_dir = "{BOARD_CACHE}"
# debug, info, warning or error (logs go to stderr; under the units, the journal).
log_level = "info"
# Free the KV-cache slots when the starter has been silent this many seconds.
idle_timeout_s = {IDLE_TIMEOUT_S:g}
# Microseconds a wait for the next activation polls the data link before it sleeps: a
# message that comes sooner saves the wake-up from sleep (tens of µs a hop) at the price of
# that much CPU. 0: sleep at once (the least power).
busy_poll_us = {BUSY_POLL_US}
{_ENCRYPT}{_secret_keys(secret_file, "ports")}
# Optional: a model to load at start (before telling systemd READY=1), so a starter
# assigning the same blocks finds them ready; under the units, a folder the service can read.
# model = "/var/lib/mdiedge/models/tinyllama"
# Only with model: the block range [first, end) of it to load (default: every block).
# layers = [10, 22]
# Only with model: the device of the loaded blocks, "cpu" or "cuda".
# device = "cpu"
# Only with model: the dtype of the loaded blocks, {_DTYPES}.
# dtype = "float32"
"""


_ENCRYPT = """\
# false: the data links go unsealed, as with --no-encrypt (every node of a ring must agree,
# or the link set-up fails): for measuring the cost of sealing only. Activations then travel
# in plaintext and unauthenticated after the handshake.
encrypt = true
"""


def _secret_keys(secret_file: str, drives: Optional[str]) -> str:
    """``drives``: what a node without a secret exposes; None for a ring file's [starter]."""
    text = f"""\
# File holding the ring secret: one line, readable by its owner alone (mode 0600). Every
# node of a ring holds the same secret (`mdiedge config init` made this one): copy the file
# to each board. The shipped units hand {BOARD_SECRET} to the node on its standard input
# (--secret-fd 0, which wins).
secret_file = {_toml(secret_file)}
# secret_file = "{BOARD_SECRET}"
# The ring secret itself, at least 16 bytes, instead of secret_file (then make this file
# unreadable to others). Neither set: $MDIEDGE_SECRET, else $MDIEDGE_SECRET_FILE.
# secret = "put the output of: openssl rand -hex 32\""""
    if drives is None:
        return text
    return text + f"""
# true: listen on a non-loopback address without a secret (anyone who reaches the {drives} can
# drive the node). Only for isolated test networks.
# insecure = false"""


# the [starter] keys but host and the secret, each with the comment that explains it, in the
# skeleton's order
_SHARED_KEYS: List[Tuple[str, str]] = [
    ("control_port", f"""\
# HTTP control port of the starter (generation requests, ring status).
control_port = {STARTER_CONTROL_PORT}"""),
    ("model", """\
# The model the ring runs, as --model takes it; unset: the shipped NanoLlama. Under the
# shipped unit, a folder the service can read (under /var/lib/mdiedge, its state directory).
# model = "/var/lib/mdiedge/models/tinyllama\""""),
    ("tokenizer", """\
# Optional: a tokenizer file, if not the model's own (tokenizer.model or tokenizer.json).
# tokenizer = "/var/lib/mdiedge/models/tinyllama/tokenizer.model\""""),
    ("device", """\
# Device of the starter's own share of the layers: "cpu" or "cuda".
device = "cpu"
# device = "cuda\""""),
    ("dtype", f"""\
# Weight dtype on the ring: {_DTYPES}.
dtype = "float32\""""),
    ("weight", """\
# Relative speed of this board: layers are split in proportion to the weights.
weight = 1.0"""),
    ("memory", """\
# Optional: cap the memory the starter's share may use ("4GiB", "512MiB", ...).
# memory = "4GiB\""""),
    ("layers", """\
# Optional: pin the starter to this block range [first, end) instead of the automatic split.
# layers = [0, 6]"""),
    ("max_payload", f"""\
# Largest tensor payload of one data-plane frame; a larger frame closes the link.
# max_payload = "{MAX_PAYLOAD >> 20}MiB\""""),
    ("prefill_chunk", f"""\
# Prompt tokens per prefill message, so that the nodes work on chunks of a long prompt in
# parallel and a chunk travels while the next is computed (0: the whole prompt at once).
# prefill_chunk = {PREFILL_CHUNK}"""),
    ("timeout_s", f"""\
# A message not back around the ring within this many seconds is a failure, and the node
# that froze is named.
# timeout_s = {RING_TIMEOUT_S:g}"""),
    ("stall_s", f"""\
# A worker that returns no message for this many seconds, and then does not answer on its
# control port within it either, is lost: its layers move to a spare or to the survivors.
stall_s = {STALL_S:g}"""),
    ("recover", """\
# false: a lost node fails the requests in flight instead of the ring recovering without it.
recover = true"""),
    ("rebalance_margin", f"""\
# Between requests, re-split the layers when the slowest node's measured time per block is
# this fraction above the mean (0: never).
rebalance_margin = {REBALANCE_MARGIN:g}"""),
    ("compression", """\
# Optional: codecs of every link whose [[workers]] entry names none: none, fp16, int8, or
# PREFILL:DECODE such as int8:fp16 (--compression on the command line wins).
# compression = "none\""""),
    ("quantize", """\
# Optional: quantize the blocks' float weights on load to q8_0, q4_0 or q4_1 (CPU; a GGUF
# file's blocks are kept as they are; --quantize on the command line wins).
# quantize = "q8_0\""""),
    ("threads", """\
# Optional: compute threads of the long-lived starter (--threads wins); 0 = every core
# this process may use (its CPU affinity, within a cgroup's cpu.max).
# threads = 0"""),
    ("cpu_dot", """\
# Optional: how the starter's CPU kernels multiply quantized weights (--cpu-dot wins): "q8"
# (8-bit activations, integer dot products, as llama.cpp does) or "f32" (float32, exact);
# unset: $MDIEDGE_CPU_DOT, else q8.
# cpu_dot = "q8\""""),
    ("busy_poll_us", f"""\
# Microseconds a wait for the last worker's message polls the link before it sleeps: a
# message that comes sooner saves the wake-up from sleep at the price of that much CPU.
# 0: sleep at once (the least power).
busy_poll_us = {BUSY_POLL_US}"""),
    ("encrypt", _ENCRYPT.rstrip("\n")),
]


def _starter_keys(secret_file: str, starter: bool) -> List[Tuple[str, str]]:
    return [
        ("host", ("""\
# Listen address of the starter's control port, and the address the last worker connects
# back to: loopback on one machine. On a ring of boards: this board's address.""" if starter
                  else """\
# Address the last worker connects back to (the command reading this file listens there):
# loopback on one machine. On a ring of boards: this machine's address.""") + """
host = "127.0.0.1"
# host = "10.0.0.1\""""),
    ] + _SHARED_KEYS + [
        ("secret", _secret_keys(secret_file, "port" if starter else None))]


# the keys a ring file's [starter] holds: those of load_ring's options
RING_KEYS = ("host", "device", "weight", "memory", "layers", "max_payload", "prefill_chunk",
             "timeout_s", "stall_s", "recover", "rebalance_margin", "compression", "quantize",
             "busy_poll_us", "encrypt", "secret")


def _workers() -> str:
    first = f"""\
# One [[workers]] table per worker, in ring order: as written, the workers of
# `mdiedge config init worker` and `mdiedge config init worker --name w2` on this machine.
[[workers]]
# The worker's name (as in its own config).
name = "w1"
# Address the starter reaches the worker at: on a ring of boards, the worker's board.
host = "127.0.0.1"
# host = "10.0.0.2"
# The worker's control_port.
control_port = {WORKER_CONTROL_PORT}
# Device the worker runs its layers on: "cpu" or "cuda".
device = "cpu"
# device = "cuda"
# Relative speed of the worker: layers are split in proportion to the weights.
weight = 1.0
# Optional: cap the memory the worker's share may use.
# memory = "6GiB"
# Optional: pin the worker to this block range [first, end).
# layers = [6, 14]
# true: a spare, given no layers until a worker is lost; it then takes that worker's place.
spare = false
# Optional: codecs of the link into this worker: none, fp16, int8, or PREFILL:DECODE such as
# int8:fp16 (default: the starter's --compression).
# compression = "int8"
"""
    rest = [f"""
[[workers]]
name = "w{i}"
host = "127.0.0.1"
# host = "10.0.0.{i + 1}"
control_port = {worker_ports(f"w{i}")[0]}
device = "cpu"
# device = "cuda"
""" for i in range(2, RING_WORKERS + 1)]
    return first + "".join(rest)


_STARTER_HEAD = """\
# mdiedge starter config: `mdiedge starter --config FILE` (mdiedge-starter.service reads
# /etc/mdiedge/starter.toml): the long-lived starter that owns the ring. As written it runs
# on this machine with the two workers of the worker skeleton; a commented line below a key
# is its value on a ring of boards.
"""
_RING_HEAD = """\
# mdiedge ring file: `mdiedge generate --ring FILE` (also serve, chat and status --ring):
# workers already running (`mdiedge worker`), driven by the command that reads this file,
# which is the ring's starter while it runs (its model: --model, default the shipped
# NanoLlama). As written it names the two workers of the worker skeleton on this machine; a
# commented line below a key is its value on a ring of boards.
"""


def skeleton(kind: str, secret_file: str = BOARD_SECRET, cache_dir: str = BOARD_CACHE,
             name: str = "w1") -> str:
    """``kind``: worker, starter or ring."""
    if kind == "worker":
        return _worker(name, secret_file, cache_dir)
    if kind not in KINDS:
        raise UsageError(f"unknown config kind {kind!r}; choose worker, starter or ring")
    keys = _starter_keys(secret_file, kind == "starter")
    if kind == "ring":
        keys = [(key, text) for key, text in keys if key in RING_KEYS]
    head = _STARTER_HEAD if kind == "starter" else _RING_HEAD
    return head + "\n[starter]\n" + "\n".join(text for _, text in keys) + "\n\n" + _workers()


def create_secret_file(path: Path) -> bool:
    """32 random bytes as hex, mode 0600, folder made 0700: True. An existing private file is left
    (False); ConfigError otherwise."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        check_private(os.stat(str(path)), f"ring secret {str(path)!r}", str(path))
        return False
    import secrets  # loads OpenSSL's library: not for every command

    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(32) + "\n")
    return True


def on_boards(text: str, keys: Tuple[str, ...] = ("host",)) -> str:
    """Each of ``keys``' commented board value made active, the active one a comment."""
    pattern = re.compile(r"^(%s) = (.*)\n# \1 = (.*)$" % "|".join(map(re.escape, keys)), re.M)
    return pattern.sub(lambda m: f"{m.group(1)} = {m.group(3)}\n# {m.group(1)} = {m.group(2)}",
                       text)


def configs_for_units() -> Dict[str, str]:
    """Nodes of a ring of boards, by file name (the starter's to be edited)."""
    return {"mdiedge.toml": on_boards(skeleton("worker")),
            "starter.toml": on_boards(skeleton("starter"))}
