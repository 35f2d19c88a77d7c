"""Settings files (TOML): one schema-validated format for every mdiedge process.

A file holds any of three tables::

    [worker]                  # a worker process (``mdiedge worker``)
    name = "w1"
    host = "0.0.0.0"
    control_port = 7700
    data_port = 7701
    secret_file = "/etc/mdiedge/secret"

    [starter]                 # the starter: its own share of the ring and its links
    host = "10.0.0.1"         # the last worker connects back here; the control plane listens here
    memory = "4GiB"
    layers = [0, 6]

    [[workers]]               # the ring as the starter sees it, in ring order
    name = "w1"
    host = "10.0.0.2"
    control_port = 7700
    memory = "6GiB"

A ``[[workers]]`` entry becomes a :class:`~mdiedge.base.nodes.NodeSpec`; the defaults of
every key come from :mod:`mdiedge.base.defaults` and the dtype names from
:mod:`mdiedge.base.dtypes`.

Unknown tables and keys are errors, and so are values of the wrong type (``true`` is not an
integer) or out of range. Every error is a one-line
:class:`~mdiedge.base.errors.ConfigError` that names the file, the key as a dotted path
(``worker.control_port``, ``workers[1].host``), what was expected, and the bad value (secrets
are never quoted).

Look-up order of the file (:func:`find_config`): ``--config``, ``$MDIEDGE_CONFIG``, then
``/etc/mdiedge/mdiedge.toml`` (:data:`SYSTEM_CONFIG`) if it exists. Secrets
(:func:`read_secret`): ``secret``, ``secret_file``, ``$MDIEDGE_SECRET``, ``$MDIEDGE_SECRET_FILE``.

This module needs no torch (it runs in the Python 3.8 CI job).
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import (Any, Callable, ClassVar, Dict, FrozenSet, List, Mapping, Optional, Tuple,
                    Union)

from .defaults import (IDLE_TIMEOUT_S, MAX_PAYLOAD, MAX_THREADS, REBALANCE_MARGIN,
                       RING_TIMEOUT_S, STALL_S, STARTER_CONTROL_PORT, WORKER_CONTROL_PORT, WORKER_DATA_PORT)
from .dtypes import COMPUTE_NAMES
from .errors import ConfigError
from .nodes import NodeSpec

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
MIN_SECRET_BYTES = 16

LOG_LEVELS = ("debug", "info", "warning", "error")

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}
_SIZE = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]{0,3})\s*")


def parse_bytes(value: Any, where: str) -> int:
    """A positive byte count from an integer or a size string (``"4GiB"``, ``"512MB"``,
    ``"1.5 GiB"``, ``"4096"``; units b, kb, mb, gb, tb, kib, mib, gib, tib, any case)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            n = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
            if n > 0:
                return n
    raise ConfigError(f"{where}: expected a size such as 4GiB or 512MB, got {_show(value)}")


# ------------------------------------------------------------------------------ dataclasses


@dataclass(frozen=True)
class WorkerSettings:
    """``[worker]``: how a worker process listens and what it may preload."""

    TABLE: ClassVar[str] = "worker"

    name: str = "worker"
    host: str = "127.0.0.1"
    control_port: int = WORKER_CONTROL_PORT
    data_port: int = WORKER_DATA_PORT
    threads: int = 0  # torch threads; 0: torch's default
    cache_dir: Optional[str] = None
    log_level: str = "info"
    idle_timeout_s: float = IDLE_TIMEOUT_S
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
    timeout_s: float = RING_TIMEOUT_S
    stall_s: float = STALL_S
    recover: bool = True
    rebalance_margin: float = REBALANCE_MARGIN
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

# ------------------------------------------------------------------------------ validators


class _Bad(Exception):
    """A value does not fit: ``expected`` says what would; ``shown`` replaces the value."""

    def __init__(self, expected: str, shown: Optional[str] = None) -> None:
        super().__init__(expected)
        self.expected, self.shown = expected, shown


Check = Callable[[Any], Any]


def _show(value: Any, limit: int = 80) -> str:
    """The value as it appears in a message: repr, on one line, cut at ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - e.g. a too deeply nested list
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(what: str = "a non-empty string") -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise _Bad(what)
        return value
    return check


def _host(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _Bad("a host name or address")
    return value


def _integer(low: int, high: Optional[int] = None) -> Check:
    what = f"an integer {low}..{high}" if high is not None else f"an integer >= {low}"

    def check(value: Any) -> int:
        if not _is_int(value) or value < low or (high is not None and value > high):
            raise _Bad(what)
        return int(value)
    return check


def _at_least(low: float, strict: bool) -> Check:
    def check(value: Any) -> float:
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value < low or (strict and value == low)):
            raise _Bad(f"a number {'>' if strict else '>='} {low:g}")
        return float(value)
    return check


_positive, _fraction = _at_least(0, strict=True), _at_least(0, strict=False)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad("true or false")
    return value


def _choice(options: Tuple[str, ...]) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in options:
            raise _Bad(f"one of {', '.join(options)}")
        return value
    return check


def _device(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", value):
        raise _Bad("cpu, cuda or cuda:N")
    return value


def _size(value: Any) -> int:
    try:
        return parse_bytes(value, "")
    except ConfigError:
        raise _Bad("a size in bytes such as 4GiB, 512MB or 4096") from None


def _layers(value: Any) -> Tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2 or not all(_is_int(v) for v in value)
            or not 0 <= value[0] < value[1]):
        raise _Bad("[first, last] with 0 <= first < last")
    return int(value[0]), int(value[1])


def _secret(value: Any) -> str:
    if not isinstance(value, str):
        raise _Bad("a string", _toml_type(value))
    n = len(value.encode("utf-8", "surrogatepass"))
    if n < MIN_SECRET_BYTES:
        raise _Bad(f"a secret of at least {MIN_SECRET_BYTES} bytes", f"{n} bytes (not shown)")
    return value


def _toml_type(value: Any) -> str:
    """``value``'s TOML type with an article (used where the value itself must not show)."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"),
                       (str, "a string"), (list, "an array"), (dict, "a table")):
        if isinstance(value, kind):
            return name
    return "a date/time"


_COMMON: Dict[str, Check] = {
    "device": _device, "dtype": _choice(COMPUTE_NAMES), "layers": _layers,
}
_SECRETS: Dict[str, Check] = {
    "secret": _secret, "secret_file": _string("a file path"), "insecure": _bool,
}
WORKER_SCHEMA: Dict[str, Check] = dict(
    name=_string(), host=_host, control_port=_integer(0, 65535), data_port=_integer(0, 65535),
    threads=_integer(0, MAX_THREADS), cache_dir=_string("a directory path"),
    log_level=_choice(LOG_LEVELS), idle_timeout_s=_positive, **_SECRETS,
    model=_string("a model path"), **_COMMON)
STARTER_SCHEMA: Dict[str, Check] = dict(
    host=_host, control_port=_integer(0, 65535), model=_string("a model path"),
    tokenizer=_string("a tokenizer path"), weight=_positive, memory=_size, max_payload=_size,
    timeout_s=_positive, stall_s=_positive, recover=_bool, rebalance_margin=_fraction,
    **_SECRETS, **_COMMON)
WORKERS_SCHEMA: Dict[str, Check] = dict(
    name=_string(), host=_host, control_port=_integer(1, 65535), device=_device,
    weight=_positive, memory=_size, layers=_layers, spare=_bool)
WORKERS_REQUIRED = ("host", "control_port")
TABLES = {"worker": "[worker]", "starter": "[starter]", "workers": "[[workers]]"}

# ------------------------------------------------------------------------------ loading


def _key(path: str, key: str) -> str:
    """``path.key``, quoting a key that is not a bare TOML key."""
    shown = key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
    return f"{path}.{shown}" if path else shown


def _error(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {message}".replace("\n", " "))


def _expected(source: str, key: str, value: Any, bad: _Bad) -> ConfigError:
    shown = bad.shown if bad.shown is not None else _show(value)
    return _error(source, key, f"expected {bad.expected}, got {shown}")


def _unknown(source: str, key: str, name: str, known: Mapping[str, str],
             what: str = "key") -> ConfigError:
    """``known`` maps each valid name to how it is shown."""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = (f"did you mean {known[close[0]]}?" if close
            else f"known: {', '.join(known.values())}")
    return _error(source, key, f"unknown {what} ({hint})")


def _table(raw: Any, schema: Dict[str, Check], source: str, path: str,
           required: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The checked and converted values of one table; unknown keys are errors."""
    if not isinstance(raw, dict):
        raise _error(source, path, f"expected a table, got {_show(raw)}")
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
        except _Bad as bad:
            raise _expected(source, _key(path, name), raw[name], bad) from None
    return values


def _section_rules(values: Dict[str, Any], source: str, table: str) -> None:
    """Rules between the keys of ``[worker]`` or ``[starter]``."""
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
        got = "a table [workers]" if isinstance(raw, dict) else _show(raw)
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
    return tuple(entries)


def _read_toml(path: Path, source: str) -> Dict[str, Any]:
    try:
        data = path.read_bytes()
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
    """Read and validate a settings file; every problem is a one-line ConfigError."""
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
    """The settings file to use: ``--config`` (must exist), else ``$MDIEDGE_CONFIG`` (must
    exist if set and not empty), else :data:`SYSTEM_CONFIG` if it exists, else None."""
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
    """``~`` and ``~user`` expanded where they can be."""
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
    """The shared secret: ``secret``, else ``secret_file``, else ``$MDIEDGE_SECRET``, else
    ``$MDIEDGE_SECRET_FILE``; None when there is none. Files must not be accessible to group
    or others (mode & 0o077 == 0); one trailing newline is stripped; a secret shorter than
    16 bytes is an error. ``insecure`` is left to the caller."""
    if section is not None:
        where = f"{section.source or '<settings>'}: {section.TABLE}"
        if section.secret is not None:
            return _check_length(section.secret.encode("utf-8", "surrogatepass"),
                                 f"{where}.secret")
        if section.secret_file is not None:
            return _secret_file(section.secret_file, f"{where}.secret_file")
    value = env.get(ENV_SECRET)
    if value:
        return _check_length(value.encode("utf-8", "surrogateescape"), f"${ENV_SECRET}")
    value = env.get(ENV_SECRET_FILE)
    if value:
        return _secret_file(value, f"${ENV_SECRET_FILE}")
    return None


def _check_length(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: expected a secret of at least {MIN_SECRET_BYTES} bytes, "
                          f"got {len(secret)} bytes")
    return secret


def _secret_file(name: str, where: str, read: bool = True) -> Optional[bytes]:
    """The secret in file ``name`` after the permission checks; ``read=False`` (for
    ``config check``) skips a file this user may not read and returns None."""
    path = _expand(name)
    info = _secret_io(path.stat, "stat", name, where, read)
    if info is None:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{where}: secret file {name!r} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(f"{where}: {name!r} (mode {mode:04o}) is readable by other users; "
                          f"chmod 600 it")
    data = _secret_io(path.read_bytes, "read", name, where, read)
    if data is None:
        return None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return _check_length(data, where)


def _secret_io(action: Callable[[], Any], verb: str, name: str, where: str, read: bool) -> Any:
    """``action()`` (a stat or a read of secret file ``name``) with its OSError as a one-line
    ConfigError; None where ``read`` is False and this user is refused."""
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
        return "secret set inline"
    if section.secret_file is not None:
        where = f"{section.source}: {section.TABLE}.secret_file"
        if _secret_file(section.secret_file, where, read=False) is None:
            return f"secret file {section.secret_file} (not readable by this user, unchecked)"
        return f"secret file {section.secret_file}"
    if section.insecure:
        return "insecure (no secret)"
    return "secret from the environment if set"


def check_config(path: Union[str, "os.PathLike[str]"]) -> str:
    """Validate a settings file (and its secret files) and summarise it in one paragraph."""
    settings = load_settings(path)
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
        n = len(settings.workers)
        ring = ", ".join(f"{e.name} at {e.address}" for e in settings.workers)
        parts.append(f"{n} worker{'s' if n != 1 else ''} in the ring ({ring})")
    if not parts:
        return f"{settings.source}: valid, but holds no tables ([worker], [starter] or " \
               f"[[workers]])."
    return f"{settings.source}: valid; " + "; ".join(parts) + "."


def _schema_matches_dataclasses() -> None:
    """The schemas and the dataclasses name the same keys (checked at import)."""
    for schema, cls, extra in ((WORKER_SCHEMA, WorkerSettings, {"source", "keys_set"}),
                               (STARTER_SCHEMA, StarterSettings, {"source", "keys_set"}),
                               (WORKERS_SCHEMA, NodeSpec, set())):
        names = {f.name for f in fields(cls)} - extra
        assert names == set(schema), (cls.__name__, names ^ set(schema))


_schema_matches_dataclasses()
