"""Chat templates: a model's own (``tokenizer_config.json``'s ``chat_template``, a
``chat_template.jinja`` beside it, or a GGUF file's) rendered as transformers'
``apply_chat_template(messages, add_generation_prompt=True)``, else ``DEFAULT_TEMPLATE``. The text
holds its own special tokens, so its ids get none added.

The default is a plain dialogue (NanoLlama's Tiny Shakespeare shape)::

    SYSTEM:
    You are terse.

    USER:
    Hello

    ASSISTANT:"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from ...base import defaults
from ...base.errors import (ApiError, ChatTemplateError, ConfigError, ContextExceeded,
                            ConversationError)
from ...model import gguf_vocab
from ...model.tokenizer import Tokenizer, gguf_chat, read_tokenizer_config, token_text
from .schema import ChatMessage
from .toolprompt import supports_tools, template_inputs
from .tools import ToolRequest

DEFAULT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# where an answer under the default template ends: a role's line (a model without a chat
# template of its own, such as a base model, would go on to write the next turn)
DEFAULT_STOPS = ("\nUSER:", "\nASSISTANT:", "\nSYSTEM:")


def _raise_exception(message: str) -> None:
    text = " ".join(str(message).split())
    raise ConversationError(text if len(text) <= 300 else text[:300] + "...")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def load_model_template(model_path: Path) -> Dict[str, Any]:
    """A GGUF file's own, else its folder's (``{"template": None}`` when none)."""
    if model_path.is_file() and gguf_vocab.is_gguf(model_path):
        return dict(gguf_chat(model_path))
    folder = model_path if model_path.is_dir() else model_path.parent
    config = read_tokenizer_config(folder)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    found = {key: token_text(config.get(key)) for key in SPECIAL_TOKENS}
    return {"template": template or None, **{k: v for k, v in found.items() if v is not None}}


class ChatTemplate:
    """Compiled once in the limited sandbox; ``context``: the tokens a prompt may take, bounding its
    size."""

    def __init__(self, source: Optional[str] = None, bos_token: str = "", eos_token: str = "",
                 context: int = defaults.API_CONTEXT, **tokens: str) -> None:
        import jinja2
        import jinja2.ext

        from . import sandbox

        self.source = source or DEFAULT_TEMPLATE
        self.is_default = source is None
        self.native_tools = supports_tools(self.source)  # else toolprompt's generic prompt
        self.stops = DEFAULT_STOPS if self.is_default else ()
        self.tokens = dict(tokens, bos_token=bos_token, eos_token=eos_token)
        self.limits = sandbox.Limits.for_context(context)
        self._renderers: Optional[ThreadPoolExecutor] = None
        if len(self.source) > defaults.TEMPLATE_MAX_SOURCE:
            raise ConfigError(f"chat template: {len(self.source)} characters, over the limit "
                              f"of {defaults.TEMPLATE_MAX_SOURCE}")
        env = sandbox.LimitedEnvironment(
            {"tojson": _tojson}, {"raise_exception": _raise_exception,
                                  "strftime_now": lambda fmt: datetime.now().strftime(fmt)},
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        try:
            self.template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template: line {e.lineno}: {e.message}") from None
        except Exception as e:  # noqa: BLE001 - nested too deeply for jinja or Python
            raise ConfigError(f"chat template: cannot be compiled: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}") from None

    @classmethod
    def for_model(cls, model_path: Path, tokenizer: Optional[Tokenizer] = None,
                  context: int = defaults.API_CONTEXT) -> "ChatTemplate":
        """``tokenizer`` names the BOS and EOS its config does not (the default template's BOS: only
        when the tokenizer gives prompts one)."""
        found = load_model_template(model_path)
        source = found.pop("template")
        if tokenizer is not None:
            for key, token_id in (("bos_token", tokenizer.bos_id),
                                  ("eos_token", tokenizer.eos_id)):
                if key not in found and token_id is not None:
                    found[key] = tokenizer.token(token_id)
            if source is None and not tokenizer.adds_bos:
                found["bos_token"] = ""
        elif source is None:
            found["bos_token"] = ""
        return cls(source, context=context, **found)

    def prompt(self, messages: Sequence[ChatMessage],
               tools: Optional[ToolRequest] = None) -> str:
        """Special tokens included (encode with nothing added), ``tools`` as toolprompt.py renders
        them: ConversationError for the template's refusal, ContextExceeded for a text that cannot
        fit, ChatTemplateError for any other failure."""
        from . import sandbox

        sandbox.check_fits("the messages hold", sum(
            len((m.content or "").encode("utf-8", "surrogatepass")) for m in messages),
            self.limits)
        plain, shown = template_inputs(messages, tools, self.native_tools)
        return sandbox.render(self.template, self.limits, dict(
            messages=plain, add_generation_prompt=True, tools=shown, documents=None,
            **self.tokens))

    def render(self, messages: Sequence[ChatMessage],
               tools: Optional[ToolRequest] = None) -> str:
        """``prompt``, its failures 400s."""
        try:
            return self.prompt(messages, tools)
        except ConversationError as e:
            raise ApiError(400, f"messages: {e}", "messages", "invalid_conversation") from None
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", "messages", "template_error") from None
        except ContextExceeded as e:
            raise ApiError(400, f"messages: {e}", "messages", "context_length_exceeded") from None

    async def render_async(self, messages: Sequence[ChatMessage],
                           tools: Optional[ToolRequest] = None) -> str:
        """On the template's own thread: a render ends itself by its deadline, a caller waits a
        second past it at most."""
        if self._renderers is None:
            self._renderers = ThreadPoolExecutor(defaults.TEMPLATE_THREADS,
                                                 thread_name_prefix="mdiedge-template")
        future = self._renderers.submit(self.render, messages, tools)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future),
                                          self.limits.deadline_s + 1.0)
        except asyncio.TimeoutError:
            raise ApiError(400, f"messages: the chat template did not finish within "
                           f"{self.limits.deadline_s:g} s", "messages", "template_error") from None
