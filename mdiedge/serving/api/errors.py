"""The one rule that maps mdiedge's errors onto API errors in OpenAI's shape (``ApiError`` of
``mdiedge.base.errors``: an HTTP status and ``{"error": {"message", "type", "param", "code"}}``)."""
from __future__ import annotations

from ...base.errors import (ApiError, ConfigError, Conflict, ContextExceeded, FrameError,
                            GenerationError, MdiedgeError, QueueFull, RingError, SlotError,
                            TokenizerError)


def api_error(error: BaseException) -> ApiError:
    """The API error for any exception a request raised: a bad request is a 400, a ring that
    failed a 503, anything else a 500 (its message, one line)."""
    if isinstance(error, ApiError):
        return error
    message = str(error).replace("\n", " ") or type(error).__name__
    if isinstance(error, QueueFull):
        return ApiError(429, message, code="queue_full", retry_after=5)
    if isinstance(error, ContextExceeded):
        return ApiError(400, message, code="context_length_exceeded")
    if isinstance(error, (GenerationError, TokenizerError, ConfigError)):
        return ApiError(400, message)
    if isinstance(error, (RingError, Conflict, FrameError, SlotError)):  # the ring, not the request
        return ApiError(503, message, code="ring_unavailable", retry_after=5)
    if isinstance(error, MdiedgeError):
        return ApiError(500, message, code="server_error")
    return ApiError(500, f"{type(error).__name__}: {message}", code="internal_error")
