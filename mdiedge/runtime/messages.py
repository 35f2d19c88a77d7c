"""The one message type of the data plane: what the scheduler submits, what a stage takes and
returns, and what a link frames. Both ends of a link use it; nothing else crosses modules.

A message concerns rows of samples (a ring-wide sample id and the position of the row's first token)
and, for ACTIVATION and PING, carries one array: ``(B, T, dim)`` hidden states (numpy as received; a
torch tensor as a torch chunk made it, framed through ``.numpy()``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

from . import framing
from ..base.codecs import NAMES as CODEC_NAMES, NO_COMPRESSION, Compression
from ..base.errors import FrameError

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
    hidden: Optional[Any] = None  # (B, T, dim) for ACTIVATION and PING: any array
    prefill: bool = False  # a prompt chunk: slots of rows at position 0 are allocated
    seq: int = 0  # the starter's message number; comes back unchanged
    # early exit (decode only): blocks run before the whole message exited (0: it did not);
    # after an exit the hidden states are the exit states and later nodes only fill KV
    exit_depth: int = 0
    # per row, eligible to exit in this step (sticky: once eligible, eligible for the
    # blocks after it, on this node and the next); empty: no row is
    eligible: List[bool] = field(default_factory=list)
    # rows may start at or before their KV fill, the rows past their start dead
    # (speculative decoding: a verification wrote more positions than the model kept; the
    # prompt cache: a prefill after the prefix a parked sample's rows hold)
    rewind: bool = False
    # a prefill whose every row goes back (not only its last): the head scores the prompt
    all_rows: bool = False

    @property
    def tokens(self) -> int:
        """Token rows this message computes: B x T."""
        if self.hidden is None:
            return 0
        return int(self.hidden.shape[0] * self.hidden.shape[1])

    def reply(self, hidden: Optional[Any]) -> "Message":
        """The same rows, carrying ``hidden``."""
        return Message(self.kind, self.sample_ids, self.positions, hidden, self.prefill, self.seq,
                       self.exit_depth, self.eligible, self.rewind, self.all_rows)


def send(sock: Any, message: Message, codecs: Compression = NO_COMPRESSION,
         sealer: Optional[Any] = None) -> int:
    """Frame ``message`` onto ``sock`` (its tensor moved to the CPU first if need be), a
    float32 tensor encoded with the link's prefill or decode codec, sealed with ``sealer``
    on a sealed link (``mdiedge.runtime.seal``). The bytes sent."""
    if message.hidden is None:
        return framing.send_control(sock, message.kind, message.sample_ids, message.positions,
                                    seq=message.seq, exit_depth=message.exit_depth,
                                    eligible=message.eligible, sealer=sealer)
    flags = (framing.FLAG_PREFILL if message.prefill else 0) | \
        (framing.FLAG_REWIND if message.rewind else 0) | \
        (framing.FLAG_ALL_ROWS if message.all_rows else 0)
    return framing.send_tensor(sock, message.kind, message.sample_ids, message.positions,
                               message.hidden, flags=flags, seq=message.seq,
                               codec=codecs.code(message.prefill),
                               exit_depth=message.exit_depth, eligible=message.eligible,
                               sealer=sealer)


def receive(source: Any, max_payload: int, codecs: Compression = NO_COMPRESSION,
            opener: Optional[Any] = None) -> Tuple[Message, int]:
    """One message from ``source`` (a link's ``framing.reader``, or a socket) and the bytes
    its frame took; FrameError (close the link) on anything malformed, or on a float32
    payload in another codec than the link agreed on; on a sealed link (``opener``) an
    IntegrityError for a frame whose tag does not verify."""
    header, tensor = framing.recv_frame(source, max_payload, opener=opener)
    prefill = bool(header.flags & framing.FLAG_PREFILL)
    codec = framing.codec_of(header.flags)
    if tensor is not None and tensor.dtype == np.float32 and codec != codecs.code(prefill):
        raise FrameError(f"a {'prefill' if prefill else 'decode'} frame in codec "
                         f"{CODEC_NAMES[codec]} on a link that agreed on {codecs}")
    eligible = list(header.eligible) if any(header.eligible) else []
    message = Message(header.msg_type, list(header.sample_ids), list(header.positions), tensor,
                      prefill, header.seq, header.exit_depth, eligible,
                      bool(header.flags & framing.FLAG_REWIND),
                      bool(header.flags & framing.FLAG_ALL_ROWS))
    return message, framing.frame_bytes(header)


def nbytes(message: Message) -> int:
    hidden = message.hidden
    return 0 if hidden is None else int(hidden.nbytes)
