"""Settings files (TOML): one schema-validated format for every mdiedge process; README.md lists
every key. Unknown tables and keys, wrong types (``true`` is not an integer) or out-of-range values
are one-line ``ConfigError``s naming the file, the dotted key (``workers[1].host``), what was
expected and the value (secrets never quoted). No torch here (the Python 3.8 CI job imports it)."""
from __future__ import annotations

import difflib
import json
import os
import re
import stat
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import (Any, Callable, ClassVar, Dict, FrozenSet, List, Mapping, Optional,
                    Sequence, Tuple, Union)

from .codecs import COMPRESSION_NAMES
from .defaults import (BUSY_POLL_US, CPU_DOTS, IDLE_TIMEOUT_S, MAX_BUSY_POLL_US,
                       MAX_CONFIG_BYTES, MAX_PAYLOAD, MAX_SECRET_BYTES, MAX_THREADS,
                       PREFILL_CHUNK, REBALANCE_MARGIN, RING_TIMEOUT_S, STALL_S,
                       STARTER_CONTROL_PORT, WORKER_CONTROL_PORT, WORKER_DATA_PORT)
from .dtypes import COMPUTE_NAMES, QUANTIZERS
from .errors import BadValue, ConfigError
from .nodes import NodeSpec
from .smallfiles import check_secret, read_small_file
from .valuechecks import (MIN_SECRET_BYTES, Check, boolean, choice, device_name, fraction,
                     host_name, integer, layer_range, parse_bytes, positive, secret_value, show,
                     size, string)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11
    import tomli as tomllib

__all__ = ["SYSTEM_CONFIG", "ENV_CONFIG", "ENV_SECRET", "ENV_SECRET_FILE", "MIN_SECRET_BYTES",
           "WorkerSettings", "StarterSettings", "Settings", "load_settings",
           "find_config", "read_secret", "check_config", "parse_bytes"]

SYSTEM_CONFIG = Path("/etc/mdiedge/mdiedge.toml")  # tests patch this module constant
ENV_CONFIG = "MDIEDGE_CONFIG"
ENV_SECRET = "MDIEDGE_SECRET"
ENV_SECRET_FILE = "MDIEDGE_SECRET_FILE"

LOG_LEVELS = ("debug", "info", "warning", "error")

# ------------------------------------------------------------------------------ dataclasses


@dataclass(frozen=True)
class WorkerSettings:
    """``[worker]``: how a worker process listens and what it may preload."""

    TABLE: ClassVar[str] = "worker"

    name: str = "worker"
    host: str = "127.0.0.1"
    control_port: int = WORKER_CONTROL_PORT
    data_port: int = WORKER_DATA_PORT
    threads: int = 0  # compute threads; 0: every core this process may use
    cpu_dot: Optional[str] = None  # q8 or f32 (mdiedge.base.cpudot); None: $MDIEDGE_CPU_DOT
    cache_dir: Optional[str] = None
    log_level: str = "info"
    idle_timeout_s: float = IDLE_TIMEOUT_S
    busy_poll_us: int = BUSY_POLL_US  # of the inbound link, before a wait sleeps
    encrypt: bool = True  # seal the data links (false: for measurements only)
    secret: Optional[str] = field(default=None, repr=False)
    secret_file: Optional[str] = None
    insecure: bool = False
    model: Optional[str] = None  # preload this model at start
    layers: Optional[Tuple[int, int]] = None  # [first, last) of ``model``; only with model
    device: str = "cpu"
    dtype: str = "float32"
    source: str = field(default="", compare=False, repr=False)  # the file, for messages
    keys_set: FrozenSet[str] = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True)
class StarterSettings:
    """``[starter]``: the starter's own share of the ring, its addresses and its limits."""

    TABLE: ClassVar[str] = "starter"

    host: str = "127.0.0.1"
    control_port: int = STARTER_CONTROL_PORT
    model: Optional[str] = None  # None: the shipped model
    tokenizer: Optional[str] = None
    device: str = "cpu"
    dtype: str = "float32"
    weight: float = 1.0
    memory: Optional[int] = None  # bytes
    layers: Optional[Tuple[int, int]] = None
    max_payload: int = MAX_PAYLOAD  # bytes
    prefill_chunk: int = PREFILL_CHUNK  # tokens
    timeout_s: float = RING_TIMEOUT_S
    stall_s: float = STALL_S
    recover: bool = True
    rebalance_margin: float = REBALANCE_MARGIN
    compression: str = "none"  # codecs of every link whose worker names none
    quantize: str = ""  # the block type the ring's float blocks are quantized to ("": none)
    threads: int = 0  # compute threads; 0: every core this process may use
    cpu_dot: Optional[str] = None  # q8 or f32 (mdiedge.base.cpudot); None: $MDIEDGE_CPU_DOT
    busy_poll_us: int = BUSY_POLL_US  # of the link back from the last worker
    encrypt: bool = True  # seal the data links (false: for measurements only)
    secret: Optional[str] = field(default=None, repr=False)
    secret_file: Optional[str] = None
    insecure: bool = False
    source: str = field(default="", compare=False, repr=False)
    keys_set: FrozenSet[str] = field(default=frozenset(), compare=False, repr=False)


@dataclass(frozen=True)
class Settings:
    """A whole settings file; tables that are absent are None (``workers``: empty)."""

    worker: Optional[WorkerSettings]
    starter: Optional[StarterSettings]
    workers: Tuple[NodeSpec, ...]  # the ``[[workers]]`` entries, in ring order
    source: str


Section = Union[WorkerSettings, StarterSettings]

# ------------------------------------------------------------------------------ schemas


_CODECS = choice(COMPRESSION_NAMES)


def _quantizer(value: Any) -> str:
    """As the command line takes it ("q8_0"), stored as "Q8_0"."""
    if not isinstance(value, str) or value.upper() not in QUANTIZERS:
        raise BadValue(f"one of {', '.join(q.lower() for q in QUANTIZERS)}")
    return value.upper()


_COMMON: Dict[str, Check] = {
    "device": device_name, "dtype": choice(COMPUTE_NAMES), "layers": layer_range,
}
_SECRETS: Dict[str, Check] = {
    "secret": secret_value, "secret_file": string("a file path"), "insecure": boolean,
}
WORKER_SCHEMA: Dict[str, Check] = dict(
    name=string(), host=host_name, control_port=integer(0, 65535), data_port=integer(0, 65535),
    threads=integer(0, MAX_THREADS), cpu_dot=choice(CPU_DOTS),
    cache_dir=string("a directory path"),
    log_level=choice(LOG_LEVELS), idle_timeout_s=positive,
    busy_poll_us=integer(0, MAX_BUSY_POLL_US), encrypt=boolean, **_SECRETS,
    model=string("a model path"), **_COMMON)
STARTER_SCHEMA: Dict[str, Check] = dict(
    host=host_name, control_port=integer(0, 65535), model=string("a model path"),
    tokenizer=string("a tokenizer path"), weight=positive, memory=size, max_payload=size,
    prefill_chunk=integer(0), timeout_s=positive, stall_s=positive, recover=boolean,
    rebalance_margin=fraction, compression=_CODECS, busy_poll_us=integer(0, MAX_BUSY_POLL_US),
    quantize=_quantizer, encrypt=boolean, threads=integer(0, MAX_THREADS),
    cpu_dot=choice(CPU_DOTS), **_SECRETS,
    **_COMMON)
WORKERS_SCHEMA: Dict[str, Check] = dict(
    name=string(), host=host_name, control_port=integer(1, 65535), device=device_name,
    weight=positive, memory=size, layers=layer_range, spare=boolean, compression=_CODECS)
WORKERS_REQUIRED = ("host", "control_port")
TABLES = {"worker": "[worker]", "starter": "[starter]", "workers": "[[workers]]"}

# ------------------------------------------------------------------------------ loading


def _key(path: str, key: str) -> str:
    shown = key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
    return f"{path}.{shown}" if path else shown


def _error(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {message}".replace("\n", " "))


def _expected(source: str, key: str, value: Any, bad: BadValue) -> ConfigError:
    shown = bad.shown if bad.shown is not None else show(value)
    return _error(source, key, f"expected {bad.expected}, got {shown}")


def _unknown(source: str, key: str, name: str, known: Mapping[str, str],
             what: str = "key") -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = (f"did you mean {known[close[0]]}?" if close
            else f"known: {', '.join(known.values())}")
    return _error(source, key, f"unknown {what} ({hint})")


def _table(raw: Any, schema: Dict[str, Check], source: str, path: str,
           required: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Unknown keys are errors."""
    if not isinstance(raw, dict):
        raise _error(source, path, f"expected a table, got {show(raw)}")
    for name in raw:
        if name not in schema:
            raise _unknown(source, _key(path, name), name, {k: repr(k) for k in schema})
    values: Dict[str, Any] = {}
    for name, check in schema.items():
        if name not in raw:
            if name in required:
                raise _error(source, _key(path, name), "missing required key")
            continue
        try:
            values[name] = check(raw[name])
        except BadValue as bad:
            raise _expected(source, _key(path, name), raw[name], bad) from None
    return values


def _section_rules(values: Dict[str, Any], source: str, table: str) -> None:
    if "secret" in values and "secret_file" in values:
        raise _error(source, f"{table}.secret_file",
                     f"not allowed together with {table}.secret (set only one)")
    if values.get("insecure") and ("secret" in values or "secret_file" in values):
        other = "secret" if "secret" in values else "secret_file"
        raise _error(source, f"{table}.insecure",
                     f"true contradicts {table}.{other} (remove one of them)")


def _worker(raw: Any, source: str) -> WorkerSettings:
    values = _table(raw, WORKER_SCHEMA, source, "worker")
    _section_rules(values, source, "worker")
    if "layers" in values and "model" not in values:
        raise _error(source, "worker.layers", "only allowed together with worker.model")
    control = values.get("control_port", WORKER_CONTROL_PORT)
    data = values.get("data_port", WORKER_DATA_PORT)
    if control == data != 0:
        raise _error(source, "worker.data_port",
                     f"expected a port other than worker.control_port, got {data}")
    return WorkerSettings(**values, source=source, keys_set=frozenset(values))


def _starter(raw: Any, source: str) -> StarterSettings:
    values = _table(raw, STARTER_SCHEMA, source, "starter")
    _section_rules(values, source, "starter")
    return StarterSettings(**values, source=source, keys_set=frozenset(values))


def _workers(raw: Any, source: str) -> Tuple[NodeSpec, ...]:
    if not isinstance(raw, list):
        got = "a table [workers]" if isinstance(raw, dict) else show(raw)
        raise _error(source, "workers", f"expected an array of tables [[workers]], got {got}")
    entries: List[NodeSpec] = []
    names: Dict[str, int] = {}
    addresses: Dict[str, int] = {}
    for i, table in enumerate(raw):
        path = f"workers[{i}]"
        values = _table(table, WORKERS_SCHEMA, source, path, WORKERS_REQUIRED)
        values.setdefault("name", f"w{i + 1}")
        entry = NodeSpec(**values)
        if entry.name in names:
            raise _error(source, f"{path}.name", f"duplicate worker name {entry.name!r} (also "
                         f"workers[{names[entry.name]}])")
        if entry.address in addresses:
            raise _error(source, f"{path}.control_port",
                         f"{entry.address} is already workers[{addresses[entry.address]}] "
                         f"(every worker needs its own address)")
        names[entry.name], addresses[entry.address] = i, i
        entries.append(entry)
    if entries and all(entry.spare for entry in entries):
        raise _error(source, "workers", f"every one of the {len(entries)} workers is a spare "
                     f"(spare = true): a ring needs at least one member to set up")
    return tuple(entries)


def _read_toml(path: Path, source: str) -> Dict[str, Any]:
    try:
        data = read_small_file(path, MAX_CONFIG_BYTES, source)
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{source}: TOML syntax error: not valid UTF-8 (at line {line})"
                          ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        message = str(e).replace("\n", " ")
        if "line" not in message:  # "(at end of document)": say which line that is
            message = message.replace("end of document", f"end of document, line "
                                      f"{text.count(chr(10)) + 1}")
        raise ConfigError(f"{source}: TOML syntax error: {message}") from None
    except (RecursionError, ValueError) as e:  # deep nesting; too many digits in an integer
        message = str(e).replace("\n", " ") or type(e).__name__
        raise ConfigError(f"{source}: TOML syntax error: {message}") from None


def load_settings(path: Union[str, "os.PathLike[str]"]) -> Settings:
    source = str(path)
    raw = _read_toml(Path(path), source)
    for name, value in raw.items():
        if name not in TABLES:
            raise _unknown(source, _key("", name), name, TABLES, "table")
        if (name in ("worker", "starter") and isinstance(value, list) and value
                and all(isinstance(v, dict) for v in value)):
            raise _error(source, name, f"expected a table [{name}], got an array of tables "
                         f"[[{name}]]")
    worker = _worker(raw["worker"], source) if "worker" in raw else None
    starter = _starter(raw["starter"], source) if "starter" in raw else None
    workers = _workers(raw["workers"], source) if "workers" in raw else ()
    return Settings(worker=worker, starter=starter, workers=workers, source=source)


def find_config(explicit: Optional[str],
                env: Mapping[str, str] = os.environ) -> Optional[Path]:
    """``--config`` (must exist), else ``$MDIEDGE_CONFIG`` (must, if set), else
    :data:`SYSTEM_CONFIG` if it exists, else None."""
    if explicit is not None:
        return _must_exist(_expand(explicit), "--config")
    value = env.get(ENV_CONFIG)
    if value:
        return _must_exist(_expand(value), f"${ENV_CONFIG}")
    system = Path(SYSTEM_CONFIG)
    if system.exists():
        return _must_exist(system, "system config")
    return None


def _expand(name: str) -> Path:
    try:
        return Path(name).expanduser()
    except RuntimeError:  # no home directory to expand to
        return Path(name)


def _must_exist(path: Path, origin: str) -> Path:
    if not path.exists():
        raise ConfigError(f"{path}: file not found (named by {origin})")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a TOML file (named by {origin})")
    return path


# ------------------------------------------------------------------------------ secrets


def read_secret(section: Optional[Section],
                env: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """``secret``, ``secret_file``, ``$MDIEDGE_SECRET``, ``$MDIEDGE_SECRET_FILE``, else None. Files
    must be private (mode & 0o077 == 0); one trailing newline stripped; under 16 bytes is an error.
    """
    if section is not None:
        where = f"{section.source or '<settings>'}: {section.TABLE}"
        if section.secret is not None:
            _inline_secret_private(section)
            return check_secret(section.secret.encode("utf-8", "surrogatepass"),
                                 f"{where}.secret")
        if section.secret_file is not None:
            return _secret_file(section.secret_file, f"{where}.secret_file")
    value = env.get(ENV_SECRET)
    if value:
        return check_secret(value.encode("utf-8", "surrogateescape"), f"${ENV_SECRET}")
    value = env.get(ENV_SECRET_FILE)
    if value:
        return _secret_file(value, f"${ENV_SECRET_FILE}")
    return None


def _inline_secret_private(section: Section) -> None:
    """A file holding the secret inline must be as private as a secret file."""
    if not section.source:
        return
    try:
        mode = stat.S_IMODE(os.stat(section.source).st_mode)
    except OSError:  # not a file (settings built in memory): nothing to check
        return
    if mode & 0o077:
        raise ConfigError(f"{section.source}: {section.TABLE}.secret is set inline, but the "
                          f"file (mode {mode:04o}) is readable by other users: chmod 600 "
                          f"{section.source}, or move the secret to a secret_file")


def check_private(info: os.stat_result, shown: str, path: str) -> None:
    """The one rule for a file holding a secret: regular, readable by its owner alone."""
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{shown} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(f"{shown} (mode {mode:04o}) is readable by other users: "
                          f"chmod 600 {path}")


def _secret_file(name: str, where: str, read: bool = True) -> Optional[bytes]:
    """``read=False`` (``config check``) skips a file this user may not read."""
    path = _expand(name)
    info = _secret_io(path.stat, "stat", name, where, read)
    if info is None:
        return None
    shown = f"{where}: secret file {name!r}"
    check_private(info, shown, name)
    data = _secret_io(lambda: read_small_file(path, MAX_SECRET_BYTES, shown,
                                              lambda opened: check_private(opened, shown, name)),
                      "read", name, where, read)
    if data is None:
        return None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return check_secret(data, where)


def _secret_io(action: Callable[[], Any], verb: str, name: str, where: str, read: bool) -> Any:
    """Its OSError as a one-line ConfigError; None where not ``read`` and refused."""
    try:
        return action()
    except FileNotFoundError:
        raise ConfigError(f"{where}: secret file {name!r} not found") from None
    except PermissionError as e:
        if not read:
            return None
        raise ConfigError(f"{where}: cannot {verb} secret file {name!r}: {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot {verb} secret file {name!r}: {e.strerror or e}"
                          ) from None


# ------------------------------------------------------------------------------ check


def _secret_summary(section: Section) -> str:
    if section.secret is not None:
        _inline_secret_private(section)
        return "secret set inline"
    if section.secret_file is not None:
        where = f"{section.source}: {section.TABLE}.secret_file"
        if _secret_file(section.secret_file, where, read=False) is None:
            return f"secret file {section.secret_file} (not readable by this user, unchecked)"
        return f"secret file {section.secret_file}"
    if section.insecure:
        return "insecure (no secret)"
    return "secret from the environment if set"


def _one_worker_per_address(workers: Sequence[NodeSpec], source: str) -> None:
    """No two entries reach one control port (hosts resolved: ``localhost`` is ``127.0.0.1``); an
    unresolvable host left alone."""
    import socket

    seen: Dict[Tuple[str, int], int] = {}
    for i, entry in enumerate(workers):
        try:
            found = socket.getaddrinfo(entry.host, entry.control_port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        for address in {(str(info[4][0]), entry.control_port) for info in found}:
            if address in seen and seen[address] != i:
                other = workers[seen[address]]
                raise _error(source, f"workers[{i}].host",
                             f"{entry.address} and workers[{seen[address]}]'s {other.address} "
                             f"are one worker ({address[0]}:{address[1]}): every worker needs "
                             f"its own address")
            seen[address] = i


def _models_found(settings: Settings, find_model: Callable[[str], Any]) -> None:
    from .errors import MdiedgeError

    for section in (settings.worker, settings.starter):
        if section is not None and section.model is not None:
            try:
                find_model(section.model)
            except MdiedgeError as e:
                raise _error(settings.source, f"{section.TABLE}.model", str(e)) from None
            except PermissionError:  # not this user's to read (a unit's DynamicUser's may)
                continue


def _ring_has_secret(settings: Settings, env: Mapping[str, str]) -> None:
    """A ring names its secret, the environment holds one, or ``[starter] insecure`` goes without.
    """
    s = settings.starter
    if s is not None and (s.secret is not None or s.secret_file is not None or s.insecure):
        return
    if env.get(ENV_SECRET) or env.get(ENV_SECRET_FILE):
        return
    raise _error(settings.source, "starter.secret_file", f"a ring needs a secret: set "
                 f"secret_file (`mdiedge config init` makes one) or ${ENV_SECRET_FILE} "
                 f"(insecure = true only on an isolated test network)")


def check_config(path: Union[str, "os.PathLike[str]"],
                 find_model: Optional[Callable[[str], Any]] = None,
                 env: Mapping[str, str] = os.environ) -> str:
    """Its secret files, a ring's secret, and with ``find_model`` its models; a one-paragraph
    summary."""
    settings = load_settings(path)
    if find_model is not None:
        _models_found(settings, find_model)
    if settings.workers:
        _ring_has_secret(settings, env)
    parts: List[str] = []
    w = settings.worker
    if w is not None:
        preload = f", preloads {w.model}" + (f" layers {list(w.layers)}" if w.layers else "") \
            if w.model else ""
        parts.append(f"[worker] {w.name!r} listens on {w.host}:{w.control_port} (data port "
                     f"{w.data_port}), {w.device}/{w.dtype}{preload}, {_secret_summary(w)}")
    s = settings.starter
    if s is not None:
        model = s.model or "the shipped model"
        parts.append(f"[starter] on {s.host}:{s.control_port}, {model} on {s.device}/{s.dtype}, "
                     f"{_secret_summary(s)}")
    if settings.workers:
        _one_worker_per_address(settings.workers, settings.source)
        n = len(settings.workers)
        ring = ", ".join(f"{e.name} at {e.address}" for e in settings.workers)
        parts.append(f"{n} worker{'s' if n != 1 else ''} in the ring ({ring})")
    if not parts:
        return f"{settings.source}: valid, but holds no tables ([worker], [starter] or " \
               f"[[workers]])."
    return f"{settings.source}: valid; " + "; ".join(parts) + "."


def _schema_matches_dataclasses() -> None:
    for schema, cls, extra in ((WORKER_SCHEMA, WorkerSettings, {"source", "keys_set"}),
                               (STARTER_SCHEMA, StarterSettings, {"source", "keys_set"}),
                               (WORKERS_SCHEMA, NodeSpec, set())):
        names = {f.name for f in fields(cls)} - extra
        assert names == set(schema), (cls.__name__, names ^ set(schema))


_schema_matches_dataclasses()
