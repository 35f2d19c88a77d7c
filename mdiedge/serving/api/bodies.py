"""A request's body read within bounds: its bytes within the size limit and the time limit,
then a JSON object of valid text (every failure a 400, 408 or 413 naming it)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict

from starlette.requests import Request

from ...base.defaults import API_BODY_TIMEOUT_S
from ...base.errors import ApiError


async def read_json(request: Request, limit: int) -> Dict[str, Any]:
    """The body as a JSON object: a 413 past ``limit`` bytes, a 400 if not a JSON object."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit}",
                       code="body_too_large")
    body = bytearray()
    chunks = request.stream().__aiter__()
    deadline = time.monotonic() + API_BODY_TIMEOUT_S
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), deadline - time.monotonic())
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise ApiError(408, f"request body not received within {API_BODY_TIMEOUT_S:.0f} s",
                           code="timeout") from None
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes",
                           code="body_too_large")
    try:
        data = json.loads(bytes(body).decode("utf-8"))
    except ValueError as e:
        raise ApiError(400, f"body: not JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    try:  # "\ud800" escapes decode to lone surrogates, which no text can hold
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"body: a string holds a lone UTF-16 surrogate "
                       f"({e.object[e.start:e.end]!a})", code="invalid_json") from None
    return data
