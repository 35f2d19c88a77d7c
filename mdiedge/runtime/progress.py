"""A lost frame noticed within about a second, not after ``timeout_s``: the starter times each
message around the ring and, when the oldest one in flight is overdue (``PROGRESS_FACTOR`` times the
median of the recent round trips, at least ``PROGRESS_MIN_S``), sends a PING behind it. The ring
keeps its order, so the PING comes back after every message sent before it: when it comes back
first, a message was lost on the way; when it comes back in its turn, a node was only slow (the PING
is dropped, nothing else happens). On a sealed link the PING itself fails the frame counter the
receiving end expects (a frame is missing before it), so that link closes at once. Either way the
starter's usual recovery follows: the ring is set up again and every live request replayed, the same
text."""
from __future__ import annotations

import collections
import statistics
import time
from typing import Deque, Optional

import numpy as np

from ..base.defaults import PROGRESS_FACTOR, PROGRESS_MIN_S, PROGRESS_SAMPLES, PROGRESS_WINDOW
from . import messages
from .messages import Message

PROBE_SEQ = 0xFFFFFFFF  # the probe's message number (u32): the scheduler's never get there


class Progress:
    """The starter's messages in flight on a ring and their recent round trips."""

    def __init__(self) -> None:
        self.sent: Deque[float] = collections.deque()  # when each message in flight was sent
        self.round_trips: Deque[float] = collections.deque(maxlen=PROGRESS_WINDOW)
        self.ahead: Optional[int] = None  # a probe is out: messages sent before it, not back
        self.armed_at = 0.0  # a probe that came back in its turn: the next is timed from here
        self._probe: Optional[Message] = None

    def on_send(self, message: Message) -> None:
        self.sent.append(time.monotonic())
        hidden = message.hidden
        if self._probe is None and message.kind == messages.ACTIVATION and hidden is not None:
            payload = np.zeros((1, 1, hidden.shape[-1]), dtype=np.float32)
            self._probe = Message(messages.PING, [0], [0], payload, seq=PROBE_SEQ)

    def due(self) -> Optional[float]:
        """When a probe is due (monotonic), or None: none is, or one is out already."""
        if self.ahead is not None or not self.sent or self._probe is None or \
                len(self.round_trips) < PROGRESS_SAMPLES:
            return None
        limit = max(PROGRESS_MIN_S, PROGRESS_FACTOR * statistics.median(self.round_trips))
        return max(self.sent[0], self.armed_at) + limit

    def probe(self) -> Message:
        """The PING to send now (behind every message in flight)."""
        assert self._probe is not None
        self.ahead = len(self.sent)
        return self._probe

    def on_back(self, item: Message) -> Optional[str]:
        """None for a message of the scheduler's; for the probe, "" when it came back in its
        turn, else why a message was lost."""
        now = time.monotonic()
        if item.kind == messages.PING and item.seq == PROBE_SEQ:
            ahead, self.ahead, self.armed_at = self.ahead, None, now
            if ahead:
                return (f"a frame was lost on the way: a probe sent behind {ahead} message(s) "
                        f"in flight came back before them")
            return ""
        if self.sent:
            self.round_trips.append(now - self.sent.popleft())
        if self.ahead:
            self.ahead -= 1
        return None
