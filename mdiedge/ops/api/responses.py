"""Response bodies and stream chunks of the OpenAI API, one dataclass and one JSON mapping
each: ``Usage``, ``Completion`` (``text_completion``), ``ChatCompletion``, their chunks,
``ModelCard``; and ``finish_reason``, the map from the engine's reasons to OpenAI's."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

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

    def to_json(self) -> Dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class Choice:
    """One sample's text (a whole one, or a stream's increment) and why it ended."""

    index: int
    text: str
    finish_reason: Optional[str] = None


@dataclass
class Completion:
    id: str
    created: int
    model: str
    choices: List[Choice]
    usage: Usage

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index, "text": c.text, "logprobs": None,
                             "finish_reason": finish_reason(c.finish_reason)}
                            for c in self.choices],
                "usage": self.usage.to_json()}


@dataclass
class ChatCompletion:
    id: str
    created: int
    model: str
    choices: List[Choice]
    usage: Usage

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index, "logprobs": None,
                             "message": {"role": "assistant", "content": c.text},
                             "finish_reason": finish_reason(c.finish_reason)}
                            for c in self.choices],
                "usage": self.usage.to_json()}


@dataclass
class CompletionChunk:
    """A stream's event: one choice's increment, or (no choices) the closing usage."""

    id: str
    created: int
    model: str
    choices: List[Choice]
    usage: Optional[Usage] = None

    def to_json(self) -> Dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index, "text": c.text, "logprobs": None,
                             "finish_reason": finish_reason(c.finish_reason)}
                            for c in self.choices]}
        if self.usage is not None:
            body["usage"] = self.usage.to_json()
        return body


@dataclass
class ChatChunk:
    """A chat stream's event; ``role`` is sent once, in each choice's first chunk."""

    id: str
    created: int
    model: str
    choices: List[Choice]
    role: bool = False
    usage: Optional[Usage] = None

    def to_json(self) -> Dict[str, Any]:
        def delta(c: Choice) -> Dict[str, str]:
            d = {"role": "assistant"} if self.role else {}
            if c.text or self.role:
                d["content"] = c.text
            return d

        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{"index": c.index, "delta": delta(c), "logprobs": None,
                             "finish_reason": finish_reason(c.finish_reason)}
                            for c in self.choices]}
        if self.usage is not None:
            body["usage"] = self.usage.to_json()
        return body


@dataclass
class ModelCard:
    id: str
    created: int
    owned_by: str = "mdiedge"

    def to_json(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created,
                "owned_by": self.owned_by}
