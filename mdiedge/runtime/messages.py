"""The one message type of the data plane: what the scheduler submits, what a stage takes and
returns, and what a link frames. Both ends of a link use it; nothing else crosses modules.

A message concerns rows of samples (a ring-wide sample id and the position of the row's first
token) and, for ACTIVATION and PING, carries one tensor: ``(B, T, dim)`` hidden states.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from . import framing

ACTIVATION = framing.ACTIVATION  # hidden states to run through the next blocks
RELEASE = framing.RELEASE  # free these samples' KV slots on every node
PING = framing.PING  # echoed around the ring untouched: link overhead with no compute
SHUTDOWN = framing.SHUTDOWN  # the ring is ending: each node forwards it and stops its loop

KIND_NAMES = {ACTIVATION: "activation", RELEASE: "release", PING: "ping", SHUTDOWN: "shutdown"}


@dataclass
class Message:
    kind: int
    sample_ids: List[int] = field(default_factory=list)
    positions: List[int] = field(default_factory=list)
    hidden: Optional[torch.Tensor] = None  # (B, T, dim) for ACTIVATION and PING
    prefill: bool = False  # a prompt chunk: slots of rows at position 0 are allocated
    seq: int = 0  # the starter's message number; comes back unchanged

    @property
    def tokens(self) -> int:
        """Token rows this message computes: B x T."""
        if self.hidden is None:
            return 0
        return int(self.hidden.shape[0] * self.hidden.shape[1])

    def reply(self, hidden: Optional[torch.Tensor]) -> "Message":
        """The same rows, carrying ``hidden``."""
        return Message(self.kind, self.sample_ids, self.positions, hidden, self.prefill, self.seq)


def send(sock: Any, message: Message) -> None:
    """Frame ``message`` onto ``sock`` (its tensor moved to the CPU first if need be)."""
    if message.hidden is None:
        framing.send_control(sock, message.kind, message.sample_ids, message.positions,
                             seq=message.seq)
    else:
        flags = framing.FLAG_PREFILL if message.prefill else 0
        framing.send_tensor(sock, message.kind, message.sample_ids, message.positions,
                            message.hidden, flags=flags, seq=message.seq)


def receive(sock: Any, max_payload: int) -> Message:
    """One message from ``sock``; FrameError (close the link) on anything malformed."""
    header, tensor = framing.recv_frame(sock, max_payload)
    return Message(header.msg_type, list(header.sample_ids), list(header.positions), tensor,
                   bool(header.flags & framing.FLAG_PREFILL), header.seq)


def nbytes(message: Message) -> int:
    hidden = message.hidden
    return 0 if hidden is None else hidden.numel() * hidden.element_size()
