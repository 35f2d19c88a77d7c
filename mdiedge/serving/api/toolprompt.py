"""What a chat template renders for a conversation with tools: its messages as dicts and its
``tools`` argument (the rules are tools.py's docstring's). ``template_inputs`` is pure."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...model.toolcalls import CLOSE, OPEN
from .tools import GENERIC_PROMPT, TOOLS_WORD, ToolRequest

SYSTEM_ROLES = ("system", "developer")


def supports_tools(source: str) -> bool:
    """Whether a template renders tools itself: its source names ``tools``."""
    return TOOLS_WORD.search(source) is not None


def template_inputs(messages: Sequence[Any], tools: Optional[ToolRequest],
                    native: bool) -> Tuple[List[Dict[str, Any]], Optional[List[Dict[str, Any]]]]:
    """The messages and ``tools`` a template renders: ``native``, a template that renders
    tools itself; else the generic prompt and calls written as text."""
    shown = tools if tools is not None and tools.active else None
    if native:
        plain = [_native(m) for m in messages]
        extra = shown.instruction() if shown is not None else ""
        listed = [t.to_json() for t in shown.tools] if shown is not None else None
        return _with_system(plain, extra), listed
    return _with_system(_as_text(messages), generic_section(shown) if shown else ""), None


def generic_section(tools: ToolRequest) -> str:
    """``GENERIC_PROMPT`` with the tools, one JSON line each, and the choice's instruction."""
    lines = "\n".join(json.dumps(t.to_json(), ensure_ascii=False) for t in tools.tools)
    instruction = tools.instruction()
    return GENERIC_PROMPT.replace("TOOLS", lines) + ("\n\n" + instruction if instruction else "")


def _arguments(text: str) -> Any:
    """A call's arguments as a template writes them: the object its JSON text holds (the
    text itself where it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _native(message: Any) -> Dict[str, Any]:
    plain: Dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        plain["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": _arguments(c["function"]["arguments"])}}
            for c in message.tool_calls]
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        plain["name"] = message.name
    return plain


def call_text(name: str, arguments: str) -> str:
    """One call as the generic prompt asks a model to write it."""
    body = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _as_text(messages: Sequence[Any]) -> List[Dict[str, Any]]:
    """Messages for a template without tools: an assistant's calls in its text, each run
    of tool messages one user message of ``<tool_response>`` blocks."""
    plain: List[Dict[str, Any]] = []
    previous = None
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            if previous == "tool":
                plain[-1]["content"] += "\n" + block
            else:
                plain.append({"role": "user", "content": block})
        elif message.tool_calls:
            calls = [call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in message.tool_calls]
            plain.append({"role": message.role,
                          "content": "\n".join(([message.content] if message.content else [])
                                               + calls)})
        else:
            plain.append({"role": message.role, "content": message.content})
        previous = message.role
    return plain


def _with_system(plain: List[Dict[str, Any]], extra: str) -> List[Dict[str, Any]]:
    """``extra`` after the first message's text where that is a system message, else as a
    system message of its own before the others."""
    if not extra:
        return plain
    if plain and plain[0]["role"] in SYSTEM_ROLES:
        first = plain[0]["content"]
        return [dict(plain[0], content=f"{first}\n\n{extra}" if first else extra)] + plain[1:]
    return [{"role": "system", "content": extra}] + plain
