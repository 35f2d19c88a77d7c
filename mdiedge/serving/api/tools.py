"""Tool calling in the chat API, the request's side: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked (``ToolRequest``), assistant ``tool_calls`` and ``tool_call_id``s,
and what a chat template renders.

A template naming ``tools`` in its source (Qwen2.5's) gets them as transformers passes them. One
that does not (SmolLM2's, the default) gets ``GENERIC_PROMPT`` in its system message, the
assistant's calls as ``<tool_call>`` lines in its content, and each run of ``tool`` messages as one
user message of ``<tool_response>`` blocks. ``tool_choice: "none"`` renders no tools; ``"required"``
and a named function add an instruction."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ...base.errors import ApiError

MAX_TOOLS = 128
MAX_DESCRIPTION = 8192  # characters of a tool's description
MAX_PARAMETERS = 65536  # characters of a tool's parameters schema as JSON
MAX_DEPTH = 32  # nesting of a parameters schema
MAX_CALLS = 128  # tool_calls of one assistant message
MAX_ID = 256  # characters of a call's id
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # OpenAI's rule for a function's name
TOOL_CHOICES = ("none", "auto", "required")
TOOLS_WORD = re.compile(r"\btools\b")

# the system message's section where a chat template has no tools of its own (the Hermes
# wording that Qwen2.5's template writes); TOOLS is replaced by one JSON line per tool
GENERIC_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\nTOOLS\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
REQUIRED_INSTRUCTION = "You must answer by calling one or more of these functions."
NAMED_INSTRUCTION = 'You must answer by calling the function "NAME".'
SINGLE_INSTRUCTION = "Call at most one function."


def _fail(status: int, message: str, code: str, param: str = "tools") -> ApiError:
    return ApiError(status, message, param, code)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _depth(value: Any, limit: int) -> int:
    """Counted up to ``limit + 1``."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


@dataclass(frozen=True)
class Tool:

    name: str
    description: str
    parameters: Dict[str, Any]

    @classmethod
    def from_json(cls, i: int, body: Any) -> "Tool":
        where = f"tools[{i}]"
        if not isinstance(body, dict) or not isinstance(body.get("function"), dict):
            raise _fail(400, f"{where}: expected {{\"type\": \"function\", \"function\": "
                        f"{{...}}}}, got {_short(body)}", "invalid_type")
        if body.get("type") != "function":
            raise _fail(400, f"{where}.type: only \"function\" tools are supported, got "
                        f"{_short(body.get('type'))}", "unsupported_tool")
        function = body["function"]
        name, description = function.get("name"), function.get("description") or ""
        parameters = function.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(name, str) or not NAME.match(name):
            raise _fail(400, f"{where}.function.name: expected 1..64 letters, digits, _ or -, "
                        f"got {_short(name)}", "invalid_value")
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
            raise _fail(400, f"{where}.function.description: expected a string of at most "
                        f"{MAX_DESCRIPTION} characters, got {_short(description)}", "invalid_value")
        if not isinstance(parameters, dict) or _depth(parameters, MAX_DEPTH) > MAX_DEPTH or \
                len(json.dumps(parameters)) > MAX_PARAMETERS:
            raise _fail(400, f"{where}.function.parameters: expected a JSON schema object of at "
                        f"most {MAX_PARAMETERS} characters and {MAX_DEPTH} levels, got "
                        f"{_short(parameters)}", "invalid_value")
        return cls(name, description, parameters)

    def to_json(self) -> Dict[str, Any]:
        function: Dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """``choice``: none, auto, required or function (``function``: the one named); ``parallel``:
    more than one call per reply."""

    tools: Tuple[Tool, ...]
    choice: str = "auto"
    function: Optional[str] = None
    parallel: bool = True

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Optional["ToolRequest"]:
        """None: no tools, and no tool_choice but "none"."""
        raw = body.get("tools")
        raw = [] if raw is None else raw
        if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
            raise _fail(400, f"tools: expected a list of at "
                        f"most {MAX_TOOLS} tools, got {_short(raw)}", "invalid_value")
        tools = tuple(Tool.from_json(i, t) for i, t in enumerate(raw))
        names = [t.name for t in tools]
        if len(set(names)) < len(names):
            raise _fail(400, f"tools: a function's name given twice in {names}", "invalid_value")
        choice, function = _choice(body.get("tool_choice"), names)
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise _fail(400, f"parallel_tool_calls: expected a boolean, got {_short(parallel)}",
                        "invalid_type", "parallel_tool_calls")
        if not tools:
            return None
        return cls(tools, choice, function, parallel is not False)

    @property
    def active(self) -> bool:
        """The model is shown the tools and its output read for calls."""
        return self.choice != "none"

    @property
    def names(self) -> Tuple[str, ...]:
        return (self.function,) if self.function else tuple(t.name for t in self.tools)

    def instruction(self) -> str:
        """"" for auto."""
        lines = [REQUIRED_INSTRUCTION if self.choice == "required" else
                 NAMED_INSTRUCTION.replace("NAME", self.function or "")
                 if self.choice == "function" else ""]
        if not self.parallel:
            lines.append(SINGLE_INSTRUCTION)
        return " ".join(line for line in lines if line)

    def call_schema(self) -> Optional[Dict[str, Any]]:
        """The JSON schema of one valid ``{"name", "arguments"}`` where the choice requires a call,
        for a grammar inside ``<tool_call>`` tags; None where text may answer."""
        if self.choice not in ("required", "function"):
            return None
        return {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
            for t in self.tools if t.name in self.names]}


def _choice(value: Any, names: Sequence[str]) -> Tuple[str, Optional[str]]:
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _fail(400, f"tool_choice: expected one of {', '.join(TOOL_CHOICES)} or a "
                        f"function, got {_short(value)}", "invalid_value", "tool_choice")
        if value == "required" and not names:
            raise _fail(400, "tool_choice: \"required\" needs tools", "invalid_value",
                        "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or value.get("type") != "function":
        raise _fail(400, f"tool_choice: expected a string or {{\"type\": \"function\", "
                    f"\"function\": {{\"name\": ...}}}}, got {_short(value)}", "invalid_type",
                    "tool_choice")
    if name not in names:
        raise _fail(400, f"tool_choice: function {_short(name)} is not one of the tools",
                    "invalid_value", "tool_choice")
    return "function", name


def message_tool_calls(where: str, value: Any) -> Tuple[Dict[str, Any], ...]:
    """Each as ``{"id", "type": "function", "function": {"name", "arguments"}}`` (arguments as JSON
    text; an object taken too)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_CALLS:
        raise _fail(400, f"{where}.tool_calls: expected a "
                    f"list of at most {MAX_CALLS} calls, got {_short(value)}", "invalid_value",
                    "messages")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        ident = call.get("id", "") if isinstance(call, dict) else None
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(name, str) or not isinstance(arguments, str) or \
                not isinstance(ident, str) or call.get("type", "function") != "function":
            raise _fail(400, f"{where}.tool_calls[{j}]: expected {{\"id\": ..., \"type\": "
                        f"\"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}, "
                        f"got {_short(call)}", "invalid_type", "messages")
        if len(ident) > MAX_ID:
            raise _fail(400, f"{where}.tool_calls[{j}].id: at most {MAX_ID} characters, got "
                        f"{_short(ident)}", "invalid_value", "messages")
        calls.append({"id": ident, "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return tuple(calls)


def tool_call_id(where: str, role: str, value: Any) -> Optional[str]:
    """Required on a ``tool`` message; no other role has one."""
    if role != "tool":
        if value is not None:
            raise _fail(400, f"{where}.tool_call_id: only a tool message has one", "invalid_value",
                        "messages")
        return None
    if not isinstance(value, str) or len(value) > MAX_ID:
        raise _fail(400, f"{where}.tool_call_id: a tool message needs the id (a string of at "
                    f"most {MAX_ID} characters) of the call it answers, got {_short(value)}",
                    "invalid_type", "messages")
    return value
