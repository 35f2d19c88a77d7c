"""The one exception hierarchy of mdiedge.

Every error a user can cause (bad input, bad files, a dead node) is an ``MdiedgeError``; the CLI
prints its message on one line and exits non-zero. Every exception class of the package is defined
here (tests/test_facts.py checks it), the API's and the control plane's included: their HTTP
statuses are mapped where they are served."""
from __future__ import annotations

from typing import Any, Dict, Optional


class MdiedgeError(Exception):
    """Base class: the message is shown to the user as a single line."""

    exit_code: int = 1


class ConfigError(MdiedgeError, ValueError):
    """A model or ring configuration is invalid (missing key, wrong type, bad value)."""


class BadValue(ConfigError):
    """A value does not fit a check of ``mdiedge.base.valuechecks``: ``expected`` says what would;
    ``shown`` replaces the value in the message (a secret). The settings and the command line
    catch it and name the key or option and the value."""

    def __init__(self, expected: str, shown: Optional[str] = None) -> None:
        super().__init__(expected)
        self.expected, self.shown = expected, shown


class UsageError(ConfigError):
    """A value of the command line is wrong (out of range, not a choice, beyond the model's
    context): exit status 2, as for the command-line parser's own errors."""

    exit_code = 2


def need(ok: bool, option: str, value: Any, expected: str) -> None:
    """A command-line value out of range: a ``UsageError`` naming the option and the value.
    Every value that needs no model is checked so before anything slow."""
    if not ok:
        raise UsageError(f"{option}: expected {expected}, got {value!r}")


class TorchMissing(MdiedgeError):
    """A command or option needs torch and torch is not installed: one line naming what
    needs it and how to install it (``mdiedge.base.torchcheck.require_torch``)."""


class CheckpointError(MdiedgeError):
    """A checkpoint file is missing, truncated, or lacks a tensor of the right shape."""


class QuantError(CheckpointError, ValueError):
    """Quantized weights that cannot be used: an unknown type, a width that is not a whole number
    of blocks, rows of the wrong byte length, a block whose scale is not a finite number."""


class CpuPathRefused(MdiedgeError):
    """A model (or a part of it, or an option asked for) that the torch-free CPU path's
    compiled step cannot run; the message is the reason in one line."""


class TokenizerError(MdiedgeError):
    """A tokenizer file is missing or unusable."""


class GenerationError(MdiedgeError, ValueError):
    """A generation request cannot be served (e.g. prompt plus budget beyond the context);
    ``field``: the request's value at fault (``mdiedge.base.request``'s names), if one is."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


class GrammarError(GenerationError):
    """A grammar for constrained decoding that cannot be used: too big, too deep, or not one
    the grammar engine compiles."""


class ConversationError(GenerationError):
    """A chat template refused the conversation (its ``raise_exception``): the messages break
    the template's rules, e.g. roles that do not alternate."""


class ChatTemplateError(GenerationError):
    """A chat template failed while it rendered a conversation: jinja's error, Python's from inside
    the template (a range too big, recursion, no memory), or one of the limits a render runs under
    (steps, text made, nesting, time); the API's 400 ``template_error``, the CLI's one line."""


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


class AuthError(RingError):
    """A peer failed authentication (wrong or missing secret, replay, stale request)."""


class Conflict(MdiedgeError):
    """A node cannot take a control request in its current state (HTTP 409), e.g. a worker
    that serves another starter."""


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
    """A prompt and its token budget do not fit the context they would run in (the model's, a
    server's slots, a pipeline's): the API's 400 ``context_length_exceeded``, the CLI's one line."""
# status -> OpenAI's error type
API_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "invalid_request_error", 405: "invalid_request_error",
                   408: "invalid_request_error", 413: "invalid_request_error",
                   422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                   503: "service_unavailable"}


class ApiError(MdiedgeError):
    """An API request that ends with HTTP ``status`` and OpenAI's error body ``{"error": {"message",
    "type", "param", "code"}}``; ``retry_after``: seconds for a 429's or 503's ``Retry-After``
    header. ``mdiedge.serving.api.errors.api_error`` maps every other error onto one."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[int] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def to_json(self) -> Dict[str, Dict[str, Optional[str]]]:
        return {"error": {"message": self.message,
                          "type": API_ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> Dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
