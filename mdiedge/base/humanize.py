"""How counts and block ranges read in lines for people (tables, logs, messages): one form
everywhere. JSON keeps its own (numbers, half-open ``[first, end]`` lists)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["plural", "block_range"]


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    """``1 token``, ``2 tokens``, ``0 tokens``; ``many`` when the plural is not ``word + s``
    (``plural(n, "recovery", "recoveries")``)."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def block_range(layers: Optional[Sequence[Any]]) -> str:
    """A half-open block range ``(first, end)`` as ``[first, end)`` (``[0, 6)`` then
    ``[6, 12)``: they do not overlap); ``none`` when it holds no block or is unknown."""
    if not layers or len(layers) != 2 or layers[0] == layers[1]:
        return "none"
    return f"[{layers[0]}, {layers[1]})"
