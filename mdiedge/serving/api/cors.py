"""CORS (the Fetch standard's cross-origin rules) for browser clients of the API: the origins
``serve --cors-origins`` allows (none by default; ``*``: any) get their preflight
``OPTIONS`` answered (204 with the ``Access-Control-Allow-*`` headers, before the API key is
asked for: a browser sends none with a preflight) and ``Access-Control-Allow-Origin`` on every
response; any other origin gets no CORS header, so a browser keeps the answer from its page."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...base.errors import UsageError
from ...base import defaults

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key"  # without a request's own list


def parse_origins(text: Optional[str]) -> Tuple[str, ...]:
    """``--cors-origins``: a comma list of origins (``scheme://host[:port]``), or ``*``;
    a one-line error for an origin that is not one."""
    if not text or not text.strip():
        return ()
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest
                              or "/" in rest):
            raise UsageError(f"--cors-origins: expected origins such as "
                              f"https://app.example.com (or *), got {origin!r}")
    return origins


def allowed_origin(origin: Optional[str], origins: Sequence[str]) -> Optional[str]:
    """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, or None."""
    if not origin or not origins:
        return None
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


def preflight_headers(allowed: str, requested: Optional[str]) -> Dict[str, str]:
    return {"Access-Control-Allow-Origin": allowed, "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": (requested or ALLOWED_HEADERS)[:1024],
            "Access-Control-Max-Age": str(defaults.CORS_MAX_AGE_S), "Vary": "Origin"}


class Cors:
    """ASGI middleware: the rules above, around ``app``."""

    def __init__(self, app: Any, origins: Sequence[str]) -> None:
        self.app, self.origins = app, tuple(origins)

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.origins:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        allowed = allowed_origin(headers.get("origin"), self.origins)
        if allowed is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            extra = preflight_headers(allowed, headers.get("access-control-request-headers"))
            await send({"type": "http.response.start", "status": 204,
                        "headers": _encoded(extra)})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_origin(message: Dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + _encoded(
                    {"Access-Control-Allow-Origin": allowed, "Vary": "Origin"}))
            await send(message)

        await self.app(scope, receive, send_with_origin)


def _headers(scope: Dict[str, Any]) -> Dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _encoded(headers: Dict[str, str]) -> List[Tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
