"""Response bodies and stream chunks of the OpenAI API, one dataclass and one JSON mapping
each: ``Usage``, ``Completion`` (``text_completion``), ``ChatCompletion``, their chunks,
``ModelCard``; and ``finish_reason``, the map from the engine's reasons to OpenAI's."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional

# the engine's finish reasons -> OpenAI's ("cancelled" and "error" never reach a client)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def finish_reason(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(12).hex()}"


def sse(body: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` as is)."""
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV rows the prompt cache gave

    def to_json(self) -> Dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Choice:
    """One sample's text (a whole one, or a stream's increment) and why it ended."""

    index: int
    text: str
    finish_reason: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None  # a chat reply's (toolreplies.py)
    logprobs: Optional[Dict[str, Any]] = None  # its tokens' (``logprobs``' shapes), if asked


@dataclass
class _Reply:
    """What every completion body and stream chunk shares: its id, time, model, choices (each
    shaped by ``choice``) and, when set, the usage."""

    OBJECT: ClassVar[str] = ""
    id: str
    created: int
    model: str
    choices: List[Choice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None

    def choice(self, c: Choice) -> Dict[str, Any]:
        return {"text": c.text}

    def to_json(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {
            "id": self.id, "object": self.OBJECT, "created": self.created, "model": self.model,
            "choices": [dict(index=c.index, **self.choice(c), logprobs=c.logprobs,
                             finish_reason=finish_reason(c.finish_reason))
                        for c in self.choices]}
        if self.system_fingerprint is not None:
            body["system_fingerprint"] = self.system_fingerprint
        if self.usage is not None:
            body["usage"] = self.usage.to_json()
        return body


@dataclass
class Completion(_Reply):
    OBJECT: ClassVar[str] = "text_completion"


@dataclass
class CompletionChunk(_Reply):
    """A stream's event: one choice's increment, or (no choices) the closing usage."""

    OBJECT: ClassVar[str] = "text_completion"


@dataclass
class ChatCompletion(_Reply):
    OBJECT: ClassVar[str] = "chat.completion"

    def choice(self, c: Choice) -> Dict[str, Any]:
        if c.tool_calls:  # the text before the calls, if any
            return {"message": {"role": "assistant", "content": c.text or None,
                                "tool_calls": c.tool_calls}}
        return {"message": {"role": "assistant", "content": c.text}}


@dataclass
class ChatChunk(_Reply):
    """A chat stream's event; ``role`` is sent once, in each choice's first chunk."""

    OBJECT: ClassVar[str] = "chat.completion.chunk"
    role: bool = False

    def choice(self, c: Choice) -> Dict[str, Any]:
        delta: Dict[str, Any] = {"role": "assistant"} if self.role else {}
        if c.text or self.role:
            delta["content"] = c.text
        if c.tool_calls:
            delta["tool_calls"] = c.tool_calls
        return {"delta": delta}


@dataclass
class ModelCard:
    id: str
    created: int
    owned_by: str = "mdiedge"

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created,
                "owned_by": self.owned_by}
