"""The one exception hierarchy of mdiedge.

Every error a user can cause (bad input, bad files, a dead node) is an ``MdiedgeError``;
the CLI prints its message on one line and exits non-zero.
"""
from __future__ import annotations


class MdiedgeError(Exception):
    """Base class: the message is shown to the user as a single line."""

    exit_code: int = 1


class ConfigError(MdiedgeError, ValueError):
    """A model or ring configuration is invalid (missing key, wrong type, bad value)."""


class UsageError(ConfigError):
    """A value of the command line is wrong (out of range, not a choice, beyond the model's
    context): exit status 2, as for the command-line parser's own errors."""

    exit_code = 2


class CheckpointError(MdiedgeError):
    """A checkpoint file is missing, truncated, or lacks a tensor of the right shape."""


class QuantError(CheckpointError, ValueError):
    """Quantized weights that cannot be used: an unknown type, a width that is not a whole number
    of blocks, rows of the wrong byte length, a block whose scale is not a finite number."""


class TokenizerError(MdiedgeError):
    """A tokenizer file is missing or unusable."""


class GenerationError(MdiedgeError, ValueError):
    """A generation request cannot be served (e.g. prompt plus budget beyond the context)."""


class QueueFull(GenerationError):
    """Too many requests wait for KV slots already: try again later (HTTP 429)."""


class SlotError(MdiedgeError):
    """KV-cache slot table misuse: exhausted, unknown sample, double free."""


class FrameError(MdiedgeError):
    """A data-plane frame is malformed, oversized or truncated; the link must be closed."""


class IntegrityError(FrameError):
    """A sealed frame's tag does not verify: it was altered, replayed or reordered on the
    way, or one before it was dropped; the link must be closed."""


class PartitionError(MdiedgeError, ValueError):
    """Layers cannot be split over the nodes as requested."""


class RingError(MdiedgeError):
    """A node of the ring failed, timed out, or refused a request."""


class LinkMismatch(RingError):
    """The two ends of a data link disagree in its handshake on how it runs (set-up fails)."""


class CodecMismatch(LinkMismatch):
    """The two ends of a data link name different codecs in its handshake."""


class SealMismatch(LinkMismatch):
    """One end of a data link seals its frames and the other runs ``--no-encrypt``."""


class NodeLost(RingError):
    """Workers of a running ring are gone (dead, frozen, restarted): ``nodes`` names them.
    A starter that may recover moves their layers elsewhere and replays; otherwise it fails."""

    def __init__(self, message: str, nodes: "tuple[str, ...]") -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


class ListenError(MdiedgeError, OSError):
    """A node cannot listen on its address and port (in use, or not an address of this
    machine); the message names both and which port it is."""

    def __init__(self, host: str, port: int, what: str, error: OSError) -> None:
        reason = (error.strerror or str(error)).rstrip(".")
        shown = f"[{host}]" if ":" in host else host
        super().__init__(f"cannot listen on {shown}:{port} ({what}): "
                         f"{reason[:1].lower()}{reason[1:]}")
        self.errno = error.errno


class ContextExceeded(GenerationError):
    """A prompt and its token budget do not fit the context they would run in (the model's,
    a server's slots, a pipeline's): the API's 400 ``context_length_exceeded``, the CLI's
    one line."""
