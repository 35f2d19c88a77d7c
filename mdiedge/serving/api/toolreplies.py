"""Tool calling in the chat API, the reply's side: a finished sample's text read for calls
(``reply``: ``message.tool_calls``, ``finish_reason: "tool_calls"``, the text before the calls as
content, else null), and a streamed sample's chunks (``ChoiceStream``) as OpenAI streams them: the
text before a call as content while it is sampled, then for each call a ``delta.tool_calls`` chunk
with its index, id, type and name (arguments ""), one with its arguments, and the finish reason.
What may be a call is held until the sample ends (the start of ``<tool_call>``, an output that
begins with ``{``), then read as a whole; where it is not a valid call it is sent as content."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from ...model.toolcalls import ToolCall, ToolCallSplitter, parse_tool_calls
from .responses import Choice
from .tools import ToolRequest


def call_id() -> str:
    return f"call_{os.urandom(12).hex()}"


def _allowed(calls: Sequence[ToolCall], tools: ToolRequest) -> Sequence[ToolCall]:
    """The calls a reply gives: the first alone where parallel calls are off."""
    return calls if tools.parallel else calls[:1]


def reply(choice: Choice, tools: Optional[ToolRequest]) -> Choice:
    """A finished choice with its text read for calls (as it is, where none)."""
    if tools is None or not tools.active:
        return choice
    parsed = parse_tool_calls(choice.text, tools.names)
    if not parsed.calls:
        return choice
    calls: List[Dict[str, Any]] = [
        {"id": call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in _allowed(parsed.calls, tools)]
    return Choice(choice.index, parsed.content or "", "tool_calls", calls)


class ChoiceStream:
    """One streamed sample's chunks, from the text increments that stop strings allow."""

    def __init__(self, index: int, tools: Optional[ToolRequest]) -> None:
        self.index = index
        self.tools = tools if tools is not None and tools.active else None
        self.splitter = ToolCallSplitter() if self.tools is not None else None

    def push(self, text: str) -> List[Choice]:
        if self.splitter is not None:
            text = self.splitter.push(text)
        return [Choice(self.index, text)] if text else []

    def finish(self, rest: str, final: str, reason: Optional[str]) -> List[Choice]:
        """The last chunks: ``rest``, the text not streamed yet of ``final``, the whole
        text; ``reason``, the engine's finish reason."""
        if self.splitter is None or self.tools is None:
            return [Choice(self.index, rest, reason)]
        content, parsed = self.splitter.finish(final, self.tools.names)
        if not parsed.calls:
            return [Choice(self.index, content, reason)]
        out = [Choice(self.index, content)] if content else []
        for k, call in enumerate(_allowed(parsed.calls, self.tools)):
            out.append(Choice(self.index, "", tool_calls=[{
                "index": k, "id": call_id(), "type": "function",
                "function": {"name": call.name, "arguments": ""}}]))
            out.append(Choice(self.index, "", tool_calls=[{
                "index": k, "function": {"arguments": call.arguments}}]))
        return out + [Choice(self.index, "", "tool_calls")]
