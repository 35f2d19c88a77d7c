"""The API's decisions as pure functions (no torch, no I/O): a server's fixed sizes, how long a
client refused with a 429 should wait, and whether a request carries the API key. Whether a
request is taken is the scheduler's decision (``mdiedge.runtime.plan.QueueView``)."""
from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from ...base import defaults



@dataclass
class ServeLimits:
    """KV slots, context per slot (0: the model's, at most ``API_CONTEXT``), requests that may wait,
    body bytes, default ``max_tokens``."""

    slots: int = defaults.API_SLOTS
    context: int = 0
    max_waiting: int = defaults.API_MAX_WAITING
    max_body: int = defaults.API_MAX_BODY
    max_tokens: int = defaults.MAX_NEW_TOKENS


def retry_after_s(mean_e2e_s: float, waiting: int, slots: int) -> int:
    """About the time the queue ahead takes to drain, 1..60."""
    estimate = mean_e2e_s * (1 + waiting / max(1, slots))
    return int(min(60, max(1, math.ceil(estimate))))


def authorized(header: Optional[str], key: Optional[str],
               api_key_header: Optional[str] = None) -> bool:
    """``Authorization: Bearer`` (scheme any case, RFC 9110) or ``X-Api-Key`` (llama-server's)
    carrying ``key`` (always, without a key); compared in constant time."""
    if not key:
        return True
    if api_key_header is not None and hmac.compare_digest(api_key_header.strip().encode(),
                                                          key.encode()):
        return True
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def slot_context(asked: int, model: int) -> int:
    """``asked``, else the model's context up to ``API_CONTEXT``."""
    return asked if asked > 0 else min(model, defaults.API_CONTEXT)


@dataclass(frozen=True)
class KvModel:
    """Blocks, KV heads, head size, bytes of a value (the compute dtype), and its own context."""

    blocks: int
    kv_heads: int
    head_dim: int
    itemsize: int
    max_context: int

    def position_bytes(self, blocks: int) -> int:
        """Keys and values of one token over ``blocks`` blocks."""
        return 2 * blocks * self.kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class SlotShape:
    """``per_token`` KV bytes where ``available`` were free (None: unknown); ``chosen``: ``given``,
    ``memory`` (sized to ``share``) or ``unknown`` (the most); ``most``: what enough memory would
    give."""

    slots: int
    context: int
    per_token: int
    available: Optional[int]
    chosen: str
    most: Tuple[int, int]
    share: float = defaults.API_KV_SHARE

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.context * self.per_token

    @property
    def largest(self) -> int:
        return self.most[0] * self.most[1] * self.per_token


def slot_shape(model: KvModel, available: Optional[int], blocks_here: int,
               slots: Optional[int] = None, context: Optional[int] = None,
               share: float = defaults.API_KV_SHARE) -> SlotShape:
    """What is given, and for the rest the most within ``share`` of ``available``: up to
    ``API_SLOTS`` slots of the model's context (at most ``API_CONTEXT``), fewer slots first, then
    the context halved down to ``API_MIN_CONTEXT`` (or the model's, if shorter) for one slot; that
    floor kept even past the share."""
    top = slot_context(0, model.max_context)
    per_token = model.position_bytes(blocks_here)
    context = None if context is None else slot_context(context, model.max_context)
    most = (slots or defaults.API_SLOTS, context or top)
    if slots is not None and context is not None:
        return SlotShape(slots, context, per_token, available, "given", most, share)
    if available is None:
        return SlotShape(most[0], most[1], per_token, None, "unknown", most, share)
    tokens = int(available * share) // max(1, per_token)
    if context is None:
        context, least = top, min(top, defaults.API_MIN_CONTEXT)
        while context > least and (slots or 1) * context > tokens:
            context = max(least, context // 2)
    if slots is None:
        slots = max(1, min(defaults.API_SLOTS, tokens // context))
    return SlotShape(slots, context, per_token, available, "memory", most, share)
