"""Tool calls in a model's output text, as pure functions: the Hermes form (Qwen2.5 and many
others), one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (text before the
first is the content), and a whole output that is one such JSON object; either also inside one
fenced code block, as Qwen2.5-Coder writes them.

``ToolCallSplitter`` follows a growing text and says what a stream may show as content now: the text
before a tool call, never a suffix that could still grow into ``<tool_call>``, nothing of an output
beginning as JSON or a code fence (held until the end, then read by ``parse_tool_calls``). A call
naming no known function, or whose JSON does not parse, makes the whole text content: no calls."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Collection, List, Optional, Tuple

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FENCE = "```"
FENCE_LANGUAGES = ("", "json")
MAX_CALLS = 128  # calls read from one output


@dataclass(frozen=True)
class ToolCall:
    """Arguments as a JSON object's text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """``content`` None: none but calls; ``calls`` empty: a plain answer."""

    content: Optional[str]
    calls: Tuple[ToolCall, ...] = ()


def call_from_json(value: Any, names: Collection[str]) -> Optional[ToolCall]:
    """``{"name", "arguments"}`` (arguments also as JSON text, or absent) naming one of ``names``;
    else None."""
    if not isinstance(value, dict) or set(value) - {"name", "arguments"}:
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_call(text: str, names: Collection[str]) -> Optional[ToolCall]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return call_from_json(value, names)


def _tagged_calls(text: str, names: Collection[str]) -> Optional[List[ToolCall]]:
    """Each call between tags (the last closing tag may be missing), only blank text between; None
    where any of it is not a call."""
    calls: List[ToolCall] = []
    rest = text
    while rest:
        if not rest.startswith(OPEN) or len(calls) >= MAX_CALLS:
            return None
        body, closed, rest = rest[len(OPEN):].partition(CLOSE)
        call = _json_call(body.strip(), names)
        if call is None or (not closed and rest):
            return None
        calls.append(call)
        rest = rest.lstrip()
    return calls


def _fenced(text: str) -> Optional[str]:
    """The inside of a text that is one fenced code block (``json`` or unnamed), else None."""
    stripped = text.strip()
    head, newline, body = stripped.partition("\n")
    if not (newline and head.startswith(FENCE) and head[len(FENCE):].strip() in FENCE_LANGUAGES
            and body.rstrip().endswith(FENCE)):
        return None
    inside = body.rstrip()[:-len(FENCE)]
    return None if FENCE in inside else inside


def parse_tool_calls(text: str, names: Collection[str]) -> ParsedOutput:
    """The text as content, no calls, where it holds no valid call."""
    inside = _fenced(text)
    if inside is not None:
        parsed = parse_tool_calls(inside, names)
        if parsed.calls and parsed.content is None:
            return parsed
    start = text.find(OPEN)
    if start >= 0:
        calls = _tagged_calls(text[start:].rstrip(), names)
        if calls:
            return ParsedOutput(text[:start] if text[:start].strip() else None, tuple(calls))
        return ParsedOutput(text)
    stripped = text.strip()
    if stripped.startswith("{"):
        call = _json_call(stripped, names)
        if call is not None:
            return ParsedOutput(None, (call,))
    return ParsedOutput(text)


def _partial_open(text: str) -> int:
    """Length of the longest suffix that begins ``<tool_call>`` (0: none)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class ToolCallSplitter:
    """``push`` gives the content a stream may show now; once a call may have begun, the rest is
    held for ``finish``."""

    def __init__(self) -> None:
        self.text = ""
        self.shown = 0  # characters of ``text`` given as content
        self.holding = False  # a call (or an output that is JSON) may have begun

    def push(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        begun = self.text.lstrip() if self.shown == 0 else ""
        if begun.startswith(("{", FENCE)):
            self.holding = True
            return ""
        start = self.text.find(OPEN, self.shown)
        if start >= 0:
            self.holding = True
            return self._show(start) if self.text[:start].strip() else ""
        end = len(self.text) - _partial_open(self.text)
        if self.shown == 0 and (not self.text[:end].strip() or FENCE.startswith(begun)):
            return ""  # a leading blank, or the start of a fence: what follows decides
        return self._show(end)

    def _show(self, end: int) -> str:
        new = self.text[self.shown:end]
        self.shown = max(self.shown, end)
        return new

    def finish(self, text: str, names: Collection[str]) -> Tuple[str, ParsedOutput]:
        """(content not shown yet, the whole output's content and calls)."""
        self.text = text
        parsed = parse_tool_calls(text, names)
        if parsed.calls:  # the content is the text before the first call, or none
            return (parsed.content or "")[self.shown:], parsed
        return text[self.shown:], parsed
