"""The API's decisions as pure functions (no torch, no I/O): a server's fixed sizes, how long a
client refused with a 429 should wait, and whether a request carries the API key. Whether a
request is taken is the scheduler's decision (``mdiedge.runtime.plan.QueueView``)."""
from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Optional

from ...base import defaults



@dataclass
class ServeLimits:
    """A server's fixed sizes: KV slots (samples at once), context per slot (0: the model's,
    at most ``defaults.API_CONTEXT``),
    requests that may wait for slots, request body bytes, and the default ``max_tokens``."""

    slots: int = defaults.API_SLOTS
    context: int = 0
    max_waiting: int = defaults.API_MAX_WAITING
    max_body: int = defaults.API_MAX_BODY
    max_tokens: int = defaults.MAX_NEW_TOKENS


def retry_after_s(mean_e2e_s: float, waiting: int, slots: int) -> int:
    """Seconds a refused client should wait: about the time the queue ahead takes to drain
    (the mean request time per slot's worth of waiting requests), 1..60."""
    estimate = mean_e2e_s * (1 + waiting / max(1, slots))
    return int(min(60, max(1, math.ceil(estimate))))


def authorized(header: Optional[str], key: Optional[str]) -> bool:
    """Whether an ``Authorization`` header carries ``key`` (always, when there is none): the
    scheme ``Bearer`` in any case (RFC 9110), then the key; the key's comparison takes the
    same time wherever the two differ."""
    if not key:
        return True
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def slot_context(asked: int, model: int) -> int:
    """Tokens per KV slot: ``asked``, else the model's context up to ``API_CONTEXT``."""
    return asked if asked > 0 else min(model, defaults.API_CONTEXT)
