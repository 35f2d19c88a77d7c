"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status, and the one rule that maps mdiedge's own errors onto them."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ...base.errors import (ConfigError, ContextExceeded, FrameError, GenerationError, MdiedgeError,
                            QueueFull, RingError, SlotError, TokenizerError)
from ...runtime.control import Conflict

# status -> OpenAI error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request that ends with ``status`` and OpenAI's error body; ``retry_after``: seconds
    for a 429's or 503's ``Retry-After`` header."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[int] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def to_json(self) -> Dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> Dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


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
