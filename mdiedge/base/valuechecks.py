"""The value checks of the settings schemas (:mod:`mdiedge.base.settings`): each takes a value read
from TOML and returns it converted, or raises ``BadValue`` (of :mod:`mdiedge.base.errors`) saying
what it expected (``expected``, the text of the README key tables) and, where the value must not be
quoted (a secret), what to show instead. Also :func:`parse_bytes`, the size strings of the command
line and the files (``"4GiB"``).

This module needs no torch (it runs in the Python 3.8 CI job)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional, Tuple

from .errors import BadValue, ConfigError

__all__ = ["MIN_SECRET_BYTES", "Span", "Check", "parse_bytes", "show", "is_int", "string",
           "host_name", "integer", "at_least", "positive", "fraction", "boolean", "choice",
           "device_name", "size", "layer_range", "secret_value", "toml_type"]

MIN_SECRET_BYTES = 16

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
    raise ConfigError(f"{where}: expected a size such as 4GiB or 512MB, got {show(value)}")


Check = Callable[[Any], Any]


def _bound(x: float) -> str:
    """A bound as messages write it: ``2``, ``0.5``, ``2**40`` (a large power of two)."""
    if isinstance(x, int) and x >= 1 << 16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}"


@dataclass(frozen=True)
class Span:
    """The numbers a value may take, the one statement of a range that the command line, the
    API and the library check against: ``low`` to ``high`` (None: any finite number above),
    each end closed unless named open, whole numbers only when ``integer``."""

    low: float
    high: Optional[float] = None
    integer: bool = False
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not (value > self.low if self.low_open else value >= self.low):
            return False
        if self.high is None:
            return value < math.inf
        return value < self.high if self.high_open else value <= self.high

    @property
    def expected(self) -> str:
        """What a message says a value should be: ``a number in (0, 1]``, ``an integer >= 0``."""
        kind = "an integer" if self.integer else "a number"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {_bound(self.low)}"
        return (f"{kind} in {'(' if self.low_open else '['}{_bound(self.low)}, "
                f"{_bound(self.high)}{')' if self.high_open else ']'}")


def show(value: Any, limit: int = 80) -> str:
    """The value as it appears in a message: repr, on one line, cut at ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - e.g. a too deeply nested list
        text = f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def string(what: str = "a non-empty string") -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise BadValue(what)
        return value
    return check


def host_name(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise BadValue("a host name or address")
    return value


def integer(low: int, high: Optional[int] = None) -> Check:
    what = f"an integer {low}..{high}" if high is not None else f"an integer >= {low}"

    def check(value: Any) -> int:
        if not is_int(value) or value < low or (high is not None and value > high):
            raise BadValue(what)
        return int(value)
    return check


def at_least(low: float, strict: bool) -> Check:
    def check(value: Any) -> float:
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value < low or (strict and value == low)):
            raise BadValue(f"a number {'>' if strict else '>='} {low:g}")
        return float(value)
    return check


positive, fraction = at_least(0, strict=True), at_least(0, strict=False)


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadValue("true or false")
    return value


def choice(options: Tuple[str, ...]) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in options:
            raise BadValue(f"one of {', '.join(options)}")
        return value
    return check


def device_name(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", value):
        raise BadValue("cpu, cuda or cuda:N")
    return value


def size(value: Any) -> int:
    try:
        return parse_bytes(value, "")
    except ConfigError:
        raise BadValue("a size in bytes such as 4GiB, 512MB or 4096") from None


def layer_range(value: Any) -> Tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2 or not all(is_int(v) for v in value)
            or not 0 <= value[0] < value[1]):
        raise BadValue("[first, last] with 0 <= first < last")
    return int(value[0]), int(value[1])


def secret_value(value: Any) -> str:
    if not isinstance(value, str):
        raise BadValue("a string", toml_type(value))
    n = len(value.encode("utf-8", "surrogatepass"))
    if n < MIN_SECRET_BYTES:
        raise BadValue(f"a secret of at least {MIN_SECRET_BYTES} bytes", f"{n} bytes (not shown)")
    if not value.isprintable():
        raise BadValue("a secret of printable text", f"{n} bytes with a control character "
                       f"(not shown)")
    return value


def toml_type(value: Any) -> str:
    """``value``'s TOML type with an article (used where the value itself must not show)."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"),
                       (str, "a string"), (list, "an array"), (dict, "a table")):
        if isinstance(value, kind):
            return name
    return "a date/time"



