"""Requests of the OpenAI API, read and checked: ``CompletionRequest`` and ``ChatRequest``, both
with ``Options``. Every body error is a 400 in OpenAI's shape quoting the field and value, as OpenAI
and llama-server answer; fields of ``IGNORED`` (sent by OpenAI's clients, changing nothing here)
pass with any value."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ...base import defaults
from ...base.errors import ApiError
from ...base.request import Asked
from ...runtime.drafting import REQUEST_SPECULATE
from .tools import ToolRequest, message_tool_calls, tool_call_id
from .formats import FORMAT_FIELDS, Format, read_format
from .sampling import CHAT_LOGPROBS, COMPLETION_LOGPROBS, SAMPLING_FIELDS, asked_from

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_stop(v: Any) -> bool:
    return v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# field -> (JSON type check, what it should be); None is allowed for every optional field
_Check = Tuple[Callable[[Any], bool], str]
COMMON: Dict[str, _Check] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "top_k": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    "stop": (_is_stop, "a string or a list of strings"),
    "n": (_is_int, "an integer"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "speculate": (lambda v: isinstance(v, str), "a string"),  # extra: ngram, draft or off
    **FORMAT_FIELDS,
}
# accepted and ignored only with a value that changes nothing; any other value is a 400
NEUTRAL: Dict[str, Tuple[Any, ...]] = {
    "suffix": ("",), "echo": (False,), "best_of": (1,),  # completions' own: fields there
}
# fields OpenAI's clients send that change nothing here: accepted with any value, ignored
IGNORED = ("store", "metadata", "service_tier", "user", "reasoning_effort", "modalities",
           "prediction", "audio", "web_search_options", "safety_identifier",
           "prompt_cache_key", "verbosity")
# what a message may carry beside its role, content and name, ignored (as a client sends
# back an answer it got)
IGNORED_IN_MESSAGES = ("refusal", "annotations", "audio")
COMPLETION_FIELDS = dict(COMMON, **SAMPLING_FIELDS, **COMPLETION_LOGPROBS,
                         prompt=(lambda v: isinstance(v, (str, list)),
                                 "a string, a list of strings, token ids or lists of them"),
                         echo=(lambda v: isinstance(v, bool), "a boolean"),
                         best_of=(_is_int, "an integer"))
CHAT_FIELDS = dict(COMMON, **SAMPLING_FIELDS, **CHAT_LOGPROBS,
                   messages=(lambda v: isinstance(v, list), "a list of messages"),
                   max_completion_tokens=(_is_int, "an integer"),
                   tools=(lambda v: isinstance(v, list), "a list of tools"),
                   tool_choice=(lambda v: isinstance(v, (str, dict)), "a string or an object"),
                   parallel_tool_calls=(lambda v: isinstance(v, bool), "a boolean"))


def check_body(body: Mapping[str, Any], fields: Mapping[str, _Check],
               required: Tuple[str, ...]) -> None:
    """A 400 for the first missing, unknown, mistyped or unsupported field."""
    for name in required:
        if body.get(name) is None:
            raise ApiError(400, f"{name}: a required field is missing", name, "missing_field")
    for name, value in body.items():
        if (value is None and name not in required) or name in IGNORED:
            continue
        if name in NEUTRAL and name not in fields:
            if value not in NEUTRAL[name]:
                raise ApiError(400, f"{name}: not supported by this server, got {value!r}",
                               name, "unsupported_parameter")
            continue
        check = fields.get(name)
        if check is None:
            raise ApiError(400, f"{name}: unknown field", name, "unknown_field")
        if not check[0](value):
            raise ApiError(400, f"{name}: expected {check[1]}, got {_short(value)}", name,
                           "invalid_type")


@dataclass
class Options:
    """``asked`` (budget None: the server's default; a drawn seed where none is named), checked once
    as the body is read; the rest is how it is answered."""

    model: Optional[str] = None
    asked: Asked = Asked()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    max_tokens_key: str = "max_tokens"  # the field max_tokens came from (errors name it)
    speculate: Optional[str] = None  # speculative decoding: ngram, draft, off (None: server's)
    output: Optional[Format] = None  # a grammar the output is held to (formats.py)
    cache_prompt: bool = True  # may use and leave KV rows in the prompt cache
    ignore_eos: bool = False  # llama-server's: the end token does not end a sample
    score_prompt: bool = False  # the prompt's own logprobs too (completions' echo)
    server_stops: Tuple[str, ...] = ()  # stop strings the server adds (a chat template's)
    seeded: bool = False  # the body named a seed (else each prompt draws its own)

    @property
    def n(self) -> int:
        return self.asked.n_samples

    @property
    def top_logprobs(self) -> Optional[int]:
        return self.asked.params.top_logprobs

    @classmethod
    def from_json(cls, body: Mapping[str, Any], max_tokens_key: str = "max_tokens",
                  chat: bool = False) -> "Options":
        if body.get(max_tokens_key) is None:
            max_tokens_key = "max_tokens"
        stream_options = body.get("stream_options") or {}
        include = stream_options.get("include_usage")
        include = False if include is None else include
        if not isinstance(include, bool):
            raise ApiError(400, f"stream_options.include_usage: expected a boolean, got {include!r}",
                           "stream_options", "invalid_type")
        speculate = body.get("speculate")
        if speculate is not None and speculate not in REQUEST_SPECULATE:
            raise ApiError(400, f"speculate: expected one of {', '.join(REQUEST_SPECULATE)}, "
                           f"got {_short(speculate)}", "speculate", "invalid_value")
        return cls(body.get("model"), asked_from(body, chat, max_tokens_key),
                   bool(body.get("stream")), include, max_tokens_key, speculate,
                   read_format(body), body.get("cache_prompt") is not False,
                   seeded=body.get("seed") is not None)

    def reseeded(self) -> "Options":
        """For another prompt of the body: its own drawn seed, unless the body named one."""
        if self.seeded:
            return self
        params = dataclasses.replace(self.asked.params, seed=defaults.random_seed())
        return dataclasses.replace(self, asked=dataclasses.replace(self.asked, params=params))


TextOrIds = Union[str, Tuple[int, ...]]


@dataclass
class CompletionRequest:
    prompts: List[TextOrIds]  # each run on its own: text, or token ids
    options: Options  # its n: the samples returned per prompt
    echo: bool = False  # each choice's text starts with its prompt's
    best_of: int = 1  # samples drawn per prompt, of which the n likeliest are returned

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "CompletionRequest":
        check_body(body, COMPLETION_FIELDS, ("prompt",))
        options = Options.from_json(body)
        best_of = options.n if body.get("best_of") is None else body["best_of"]
        if best_of < options.n:
            raise ApiError(400, f"best_of: expected at least n ({options.n}), got {best_of}",
                           "best_of", "invalid_value")
        if best_of > options.n and options.stream:
            raise ApiError(400, f"best_of: {best_of} samples for n={options.n} cannot be "
                           "streamed (the best are known at the end)", "best_of",
                           "invalid_value")
        echo = body.get("echo") is True
        options.score_prompt = echo and options.top_logprobs is not None
        return cls(token_prompts(body["prompt"]), options, echo, best_of)


def token_prompts(value: Any, field: str = "prompt") -> List[TextOrIds]:
    """A string, strings, token ids or lists of them; a 400 for anything else or an empty one."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return [tuple(value)]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(
            isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
        return [tuple(v) for v in value]
    raise ApiError(400, f"{field}: expected a string, a list of strings, token ids or lists "
                   f"of token ids, none empty, got {_short(value)}", field, "invalid_value")


def token_prompt(value: Any, field: str = "prompt", empty: bool = False) -> TextOrIds:
    """A string, a list of one string, or token ids (``empty``: an empty list too); else a 400."""
    if isinstance(value, list) and not value and empty:
        return ()
    prompts = token_prompts(value, field)
    if len(prompts) != 1:
        raise ApiError(400, f"{field}: one prompt here, got {len(prompts)}", field,
                       "invalid_value")
    return prompts[0]


@dataclass
class ChatMessage:
    role: str
    content: str
    name: Optional[str] = None
    tool_calls: Tuple[Dict[str, Any], ...] = ()  # an assistant's (serving/api/tools.py)
    tool_call_id: Optional[str] = None  # a tool message's: the call it answers

    @classmethod
    def from_json(cls, i: int, body: Any) -> "ChatMessage":
        where = f"messages[{i}]"
        if not isinstance(body, dict):
            raise ApiError(400, f"{where}: expected an object, got {_short(body)}", "messages",
                           "invalid_type")
        role = body.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}",
                           "messages", "invalid_value")
        unknown = sorted(set(body) - {"role", "content", "name", "tool_calls", "tool_call_id"}
                         - set(IGNORED_IN_MESSAGES))
        if unknown:
            raise ApiError(400, f"{where}: unknown field {unknown[0]!r}", "messages", "unknown_field")
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, f"{where}.name: expected a string, got {_short(name)}",
                           "messages", "invalid_type")
        calls = message_tool_calls(where, body.get("tool_calls"))
        if calls and role != "assistant":
            raise ApiError(400, f"{where}.tool_calls: only an assistant message has them",
                           "messages", "invalid_value")
        return cls(role, _content(where, body.get("content")), name, calls,
                   tool_call_id(where, role, body.get("tool_call_id")))


def _content(where: str, content: Any) -> str:
    """A string, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content: only text parts are supported, got "
                               f"{_short(part)}", "messages", "unsupported_content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}.content: expected a string or a list of text parts, got "
                   f"{_short(content)}", "messages", "invalid_type")


@dataclass
class ChatRequest:
    messages: List[ChatMessage]
    options: Options
    tools: Optional[ToolRequest] = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "ChatRequest":
        check_body(body, CHAT_FIELDS, ("messages",))
        raw = body["messages"]
        if not raw or len(raw) > MAX_MESSAGES:
            raise ApiError(400, f"messages: expected 1..{MAX_MESSAGES} messages, got {len(raw)}",
                           "messages", "invalid_value")
        messages = [ChatMessage.from_json(i, m) for i, m in enumerate(raw)]
        return cls(messages, Options.from_json(body, "max_completion_tokens", chat=True),
                   ToolRequest.from_body(body))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
