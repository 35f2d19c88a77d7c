"""Ring files (TOML): the starter's settings and the already-running workers it drives.

    [starter]                 # all keys optional
    host = "10.0.0.1"         # address the last worker connects back to
    device = "cpu"
    weight = 1.0
    memory = "4GiB"
    layers = [0, 2]

    [[workers]]
    name = "w1"
    host = "10.0.0.2"
    control_port = 7700
    device = "cuda"
    weight = 2.0
    memory = "6GiB"
    layers = [2, 7]
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .errors import ConfigError
from .starter import WorkerAddress

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11
    import tomli as tomllib

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "kib": 1024,
          "mib": 1024 ** 2, "gib": 1024 ** 3}
STARTER_KEYS = {"host": str, "device": str, "weight": (int, float), "memory": (int, str),
                "layers": list}
WORKER_KEYS = dict(STARTER_KEYS, name=str, control_port=int)
WORKER_REQUIRED = ("host", "control_port")


def parse_bytes(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if match and match.group(2).lower() in _UNITS:
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ConfigError(f"{where}: expected a size such as 4GiB or 512MB, got {value!r}")


def _check_table(table: Any, keys: Dict[str, Any], where: str) -> Dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(keys))})")
        if not isinstance(value, keys[key]) or isinstance(value, bool):
            raise ConfigError(f"{where}.{key}: expected {_type_name(keys[key])}, got {value!r}")
    return table


def _type_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number",
                        "list": "a list"}[k.__name__] for k in kinds)


def _layers(value: Any, where: str) -> Optional[Tuple[int, int]]:
    if value is None:
        return None
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ConfigError(f"{where}.layers: expected [first, last], got {value!r}")
    return int(value[0]), int(value[1])


def load_ring(path: Path) -> Tuple[Dict[str, Any], List[WorkerAddress]]:
    """The starter's settings and the workers of a ring file; errors name the file and key."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: ring file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    _check_table(raw, {"starter": dict, "workers": list}, str(path))
    starter = _check_table(raw.get("starter", {}), STARTER_KEYS, f"{path}: [starter]")
    options: Dict[str, Any] = {
        "host": starter.get("host", "127.0.0.1"), "device": starter.get("device", "cpu"),
        "starter_weight": float(starter.get("weight", 1.0)),
        "starter_memory": parse_bytes(starter["memory"], f"{path}: [starter].memory")
        if "memory" in starter else None,
        "starter_layers": _layers(starter.get("layers"), f"{path}: [starter]"),
    }
    workers: List[WorkerAddress] = []
    for i, table in enumerate(raw.get("workers", [])):
        where = f"{path}: workers[{i}]"
        _check_table(table, WORKER_KEYS, where)
        for key in WORKER_REQUIRED:
            if key not in table:
                raise ConfigError(f"{where}: missing required key {key!r}")
        workers.append(WorkerAddress(
            name=table.get("name", f"w{i + 1}"), host=table["host"],
            control_port=table["control_port"], weight=float(table.get("weight", 1.0)),
            memory=parse_bytes(table["memory"], f"{where}.memory") if "memory" in table else None,
            layers=_layers(table.get("layers"), where), device=table.get("device", "cpu")))
    if not workers:
        raise ConfigError(f"{path}: no [[workers]]")
    return options, workers
