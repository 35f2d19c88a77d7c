"""A request's output format, read and checked: OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema`` with its ``schema``) and llama-server's ``grammar`` (GBNF)
and ``json_schema`` fields, as a ``(kind, source, field)`` that ``mdiedge.model.grammar`` compiles
(``field``: the one it came from); at most one of them. A bad shape is a 400 naming the field."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ...base.errors import ApiError

_Check = Tuple[Callable[[Any], bool], str]
FORMAT_FIELDS: Dict[str, _Check] = {
    "response_format": (lambda v: isinstance(v, dict), "an object"),
    "grammar": (lambda v: isinstance(v, str), "a string"),  # llama-server: GBNF
    "json_schema": (lambda v: isinstance(v, (dict, bool)), "an object"),  # llama-server
    "cache_prompt": (lambda v: isinstance(v, bool), "a boolean"),  # llama-server
}
Format = Tuple[str, Any, str]  # (a kind of mdiedge.model.grammar, its source, its field)


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", field.split(".")[0], "invalid_value")


def response_format(value: Mapping[str, Any]) -> Optional[Format]:
    """OpenAI's ``response_format``: None for text."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None, "response_format")
    if kind != "json_schema":
        raise _bad("response_format.type", f"expected text, json_object or json_schema, got "
                   f"{kind!r}"[:200])
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "expected an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise _bad("response_format.json_schema.name", f"expected 1..64 characters, got "
                   f"{name!r}"[:200])
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise _bad("response_format.json_schema.schema", "expected a JSON schema object")
    return ("json_schema", schema, "response_format")


def read_format(body: Mapping[str, Any]) -> Optional[Format]:
    """The one output format ``body`` asks for (None: free text); a 400 for two."""
    given = [name for name in ("response_format", "grammar", "json_schema")
             if body.get(name) is not None]
    if len(given) > 1:
        raise _bad(given[1], f"give one of response_format, grammar and json_schema, not "
                   f"{' and '.join(given)}")
    if not given:
        return None
    if given[0] == "response_format":
        return response_format(body["response_format"])
    if given[0] == "grammar":
        return ("gbnf", body["grammar"], "grammar") if body["grammar"].strip() else None
    return ("json_schema", body["json_schema"], "json_schema")
