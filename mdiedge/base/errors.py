"""The one exception hierarchy: every error a user can cause is an ``MdiedgeError``, printed on one
line by the CLI. Every exception class of the package is here (tests/test_facts.py checks it); HTTP
statuses are mapped where served."""
from __future__ import annotations

from typing import Any, Dict, Optional


class MdiedgeError(Exception):
    """Base class: the message is shown to the user as a single line."""

    exit_code: int = 1


class ConfigError(MdiedgeError, ValueError):
    """A model or ring configuration is invalid (missing key, wrong type, bad value)."""


class BadValue(ConfigError):
    """A value failing a ``valuechecks`` check: ``expected`` says what would fit; ``shown`` replaces
    the value in the message (a secret). Settings and CLI name the key or option."""

    def __init__(self, expected: str, shown: Optional[str] = None) -> None:
        super().__init__(expected)
        self.expected, self.shown = expected, shown


class UsageError(ConfigError):
    """A wrong command-line value: exit status 2, as the parser's own errors."""

    exit_code = 2


def need(ok: bool, option: str, value: Any, expected: str) -> None:
    """A ``UsageError`` naming the option and value; values needing no model are checked before
    anything slow."""
    if not ok:
        raise UsageError(f"{option}: expected {expected}, got {value!r}")


class TorchMissing(MdiedgeError):
    """One line naming what needs torch and how to install it (``torchcheck.require_torch``)."""


class CheckpointError(MdiedgeError):
    """A checkpoint file is missing, truncated, or lacks a tensor of the right shape."""


class QuantError(CheckpointError, ValueError):
    """Unknown type, width not a whole number of blocks, wrong row length, a non-finite scale."""


class CpuPathRefused(MdiedgeError):
    """What the torch-free CPU path's compiled step cannot run; the message is the reason."""


class TokenizerError(MdiedgeError):
    """A tokenizer file is missing or unusable."""


class GenerationError(MdiedgeError, ValueError):
    """A request that cannot be served; ``field``: the request's value at fault, if one is."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


class GrammarError(GenerationError):
    """Too big, too deep, or not one the grammar engine compiles."""


class ConversationError(GenerationError):
    """A chat template's ``raise_exception``: the messages break its rules."""


class ChatTemplateError(GenerationError):
    """A chat template failed rendering: jinja's error, Python's from inside, or a render limit
    (steps, text, nesting, time); the API's 400 ``template_error``."""


class QueueFull(GenerationError):
    """Too many requests wait for KV slots already (HTTP 429)."""


class SlotError(MdiedgeError):
    """KV-cache slot table misuse: exhausted, unknown sample, double free."""


class FrameError(MdiedgeError):
    """A data-plane frame is malformed, oversized or truncated; the link must be closed."""


class IntegrityError(FrameError):
    """A sealed frame's tag does not verify (altered, replayed, reordered, or one dropped before);
    close the link."""


class PartitionError(MdiedgeError, ValueError):
    """Layers cannot be split over the nodes as requested."""


class RingError(MdiedgeError):
    """A node of the ring failed, timed out, or refused a request."""


class AuthError(RingError):
    """A peer failed authentication (wrong or missing secret, replay, stale request)."""


class Conflict(MdiedgeError):
    """Not in the node's current state (HTTP 409), e.g. a worker serving another starter."""


class LinkMismatch(RingError):
    """The two ends of a data link disagree in its handshake on how it runs (set-up fails)."""


class CodecMismatch(LinkMismatch):
    """The two ends of a data link name different codecs in its handshake."""


class SealMismatch(LinkMismatch):
    """One end of a data link seals its frames and the other runs ``--no-encrypt``."""


class NodeLost(RingError):
    """``nodes``: workers gone from a running ring (dead, frozen, restarted)."""

    def __init__(self, message: str, nodes: "tuple[str, ...]") -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


class ListenError(MdiedgeError, OSError):
    """A node cannot listen on its address and port; the message names both."""

    def __init__(self, host: str, port: int, what: str, error: OSError) -> None:
        reason = (error.strerror or str(error)).rstrip(".")
        shown = f"[{host}]" if ":" in host else host
        super().__init__(f"cannot listen on {shown}:{port} ({what}): "
                         f"{reason[:1].lower()}{reason[1:]}")
        self.errno = error.errno


class ContextExceeded(GenerationError):
    """Prompt and budget beyond the context they would run in; the API's 400
    ``context_length_exceeded``."""
# status -> OpenAI's error type
API_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   404: "invalid_request_error", 405: "invalid_request_error",
                   408: "invalid_request_error", 413: "invalid_request_error",
                   422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                   503: "service_unavailable"}


class ApiError(MdiedgeError):
    """HTTP ``status`` with OpenAI's error body; ``retry_after``: a 429's or 503's ``Retry-After``
    seconds. ``serving.api.errors.api_error`` maps every other error onto one."""

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
