"""Tool calling in the chat API, deterministically: what a chat template renders for tools
(Qwen2.5's own template as transformers' ``apply_chat_template`` renders it; the generic
prompt where a template has none), and replies read for calls, whole and streamed, through
the official ``openai`` client against a server in this process whose samples are scripted
(the model's logits ignored: the script's tokens, then the end token)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import openai
import pytest

from mdiedge.engine.local import LocalEngine
from mdiedge.serving.api.chat import DEFAULT_TEMPLATE, ChatTemplate
from mdiedge.serving.api.rules import ServeLimits
from mdiedge.serving.api.schema import ChatRequest
from mdiedge.serving.api.server import Api, listen
from mdiedge.serving.api.tools import GENERIC_PROMPT, REQUIRED_INSTRUCTION, ToolRequest

HERE = Path(__file__).resolve().parent
NANOLLAMA = HERE.parent / "models" / "nanollama"
QWEN_TEMPLATE = (HERE / "data" / "qwen2.5-chat-template.jinja").read_text()
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description":
                                            "The weather in a city now", "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def rendered(template: ChatTemplate, **body: Any) -> str:
    request = ChatRequest.from_json(dict(body, messages=body.get("messages", [QUESTION])))
    return template.render(request.messages, request.tools)


def transformers_render(source: str, messages: List[Dict[str, Any]], **kwargs: Any) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    return tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                         add_generation_prompt=True, **kwargs)


def test_qwens_template_renders_tools_calls_and_results_as_transformers_does() -> None:
    qwen = ChatTemplate(QWEN_TEMPLATE)
    as_transformers = [QUESTION, dict(CALLED, content="", tool_calls=[
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]),
        RESULT]
    ours = rendered(qwen, messages=[QUESTION, CALLED, RESULT], tools=[WEATHER, TIME])
    assert ours == transformers_render(QWEN_TEMPLATE, as_transformers, tools=[WEATHER, TIME])
    assert "<tools>" in ours and '{"city": "Paris"}' in ours and "<tool_response>" in ours
    none = rendered(qwen, messages=[QUESTION], tools=[WEATHER], tool_choice="none")
    assert none == transformers_render(QWEN_TEMPLATE, [QUESTION]) == rendered(qwen)
    required = rendered(qwen, tools=[WEATHER], tool_choice="required")
    assert required.startswith(f"<|im_start|>system\n{REQUIRED_INSTRUCTION}\n\n# Tools")


def test_a_template_without_tools_gets_the_generic_prompt() -> None:
    plain = ChatTemplate(DEFAULT_TEMPLATE)
    assert not plain.native_tools and ChatTemplate(QWEN_TEMPLATE).native_tools
    text = rendered(plain, messages=[{"role": "system", "content": "Be brief."}, QUESTION,
                                     CALLED, RESULT, dict(RESULT, content="rain at 6")],
                    tools=[WEATHER], tool_choice={"type": "function",
                                                  "function": {"name": "get_weather"}},
                    parallel_tool_calls=False)
    section = GENERIC_PROMPT.replace("TOOLS", json.dumps(WEATHER))
    assert text == (
        f"SYSTEM:\nBe brief.\n\n{section}\n\nYou must answer by calling the function "
        f'"get_weather". Call at most one function.\n\n'
        f"USER:\nWhat is the weather in Paris?\n\nASSISTANT:\n{CALL_TEXT}\n\n"
        "USER:\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\nrain at 6\n</tool_response>\n\nASSISTANT:\n")
    assert rendered(plain, tools=[WEATHER], tool_choice="none") == rendered(plain)


def test_tools_are_read_as_openai_sends_them_with_a_schema_for_a_grammar() -> None:
    bare = {"type": "function", "function": {"name": "ping", "description": None,
                                             "strict": True}}
    tools = ToolRequest.from_body({"tools": [WEATHER, bare]})
    assert tools is not None and tools.choice == "auto" and tools.parallel
    assert tools.tools[1].to_json() == {"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}}
    assert tools.call_schema() is None
    assert ToolRequest.from_body({"tools": [], "tool_choice": "none"}) is None
    named = ToolRequest.from_body({"tools": [WEATHER, bare], "parallel_tool_calls": False,
                                   "tool_choice": {"type": "function",
                                                   "function": {"name": "get_weather"}}})
    assert named is not None and named.names == ("get_weather",) and not named.parallel
    assert named.call_schema() == {"anyOf": [{
        "type": "object", "properties": {"name": {"const": "get_weather"},
                                         "arguments": PARAMETERS},
        "required": ["name", "arguments"], "additionalProperties": False}]}


SCRIPT: Dict[str, str] = {"text": ""}


def written(script: str) -> str:
    """The text a script makes: NanoLlama's SentencePiece writes a space before its first
    piece."""
    return " " + script


def scripted(engine: LocalEngine) -> LocalEngine:
    """``engine`` whose every sample writes ``SCRIPT["text"]``, then ends (its end token)."""
    original = engine.generation_of

    def generation_of(*args: Any, **kwargs: Any) -> Any:
        generation = original(*args, **kwargs)
        ids, end = engine.tokenizer.encode(SCRIPT["text"]), min(generation.eos_ids)

        def accept(samples: Any, logits: Any) -> None:
            if generation.cancel_requested:
                generation.end("cancelled", samples)
                return
            for sample in samples:
                done = len(sample.tokens)
                generation.take(sample, [ids[done] if done < len(ids) else end])
        generation.accept = accept
        return generation
    engine.generation_of = generation_of  # type: ignore[assignment]
    return engine


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = scripted(LocalEngine(NANOLLAMA))
    server = Api(engine, listen("127.0.0.1", 0), ServeLimits(slots=2, context=1024),
                 name="nano").start()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        server.close()


def ask(client: openai.OpenAI, script: str, **extra: Any) -> Any:
    SCRIPT["text"] = script
    extra.setdefault("tools", [WEATHER, TIME])
    return client.chat.completions.create(model="nano", messages=[QUESTION], max_tokens=200,
                                          **extra)


def streamed(client: openai.OpenAI, script: str, **extra: Any) -> Dict[str, Any]:
    """A stream's content, calls (joined as a client joins them) and finish reason."""
    out: Dict[str, Any] = {"content": "", "calls": {}, "finish_reason": None, "pieces": []}
    for chunk in ask(client, script, stream=True, **extra):
        for choice in chunk.choices:
            out["content"] += choice.delta.content or ""
            out["pieces"].append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                slot = out["calls"].setdefault(call.index, {"id": None, "name": "", "args": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["args"] += call.function.arguments or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def test_a_call_in_the_output_is_a_tool_call(client: openai.OpenAI) -> None:
    reply = ask(client, CALL_TEXT).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    [call] = reply.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    said = ask(client, "Let me check.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome"))
    assert said.choices[0].message.content == written("Let me check.\n")
    assert [json.loads(c.function.arguments)["city"] for c in said.choices[0].message.tool_calls] \
        == ["Paris", "Rome"]
    plain_json = ask(client, '{"name": "get_time", "arguments": {}}').choices[0]
    assert plain_json.message.tool_calls[0].function.name == "get_time"


@pytest.mark.parametrize("script, extra", [
    ('<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>', {}),  # no such tool
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', {}),  # bad JSON
    (CALL_TEXT, {"tool_choice": "none"}),  # calls are not read
    (CALL_TEXT, {"tools": []}),
    (CALL_TEXT, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
])
def test_what_is_not_a_call_is_the_text(client: openai.OpenAI, script: str,
                                        extra: Dict[str, Any]) -> None:
    reply = ask(client, script, **extra).choices[0]
    assert reply.finish_reason == "stop" and reply.message.tool_calls is None
    assert reply.message.content == written(script)
    whole = streamed(client, script, **extra)
    assert (whole["content"], whole["calls"], whole["finish_reason"]) == \
        (written(script), {}, "stop")


def test_parallel_calls_off_gives_the_first_call_alone(client: openai.OpenAI) -> None:
    two = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")
    reply = ask(client, two, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments) for c in reply.message.tool_calls] == \
        [{"city": "Paris"}]
    assert len(streamed(client, two, parallel_tool_calls=False)["calls"]) == 1


def test_calls_stream_as_openai_streams_them(client: openai.OpenAI) -> None:
    script = "Checking < both > cities.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")
    out = streamed(client, script)
    assert out["content"] == written("Checking < both > cities.\n")
    assert len([p for p in out["pieces"] if p]) > 3  # the content came as it was sampled
    assert out["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["args"])) for _, c in sorted(out["calls"].items())] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in out["calls"].values())
    assert streamed(client, CALL_TEXT)["content"] == ""
