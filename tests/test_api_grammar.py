"""Structured output through a real ``mdiedge serve`` of SmolLM2 (one node, and a local ring
of 3) with the official ``openai`` client: ``response_format`` ``json_schema`` output that
validates against its schema for 20 seeded samples, ``json_object``, llama-server's
``grammar`` and ``json_schema`` fields, a call held to the tools when one is required, and
grammars that cannot be used refused with a 400 naming the field."""
from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Any, Dict, Iterator

import httpx
import openai
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from commands import MDIEDGE  # noqa: E402
from smollm2 import gguf_file  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def start(nodes: int) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen([*MDIEDGE, "serve", "--port", "0", "--nodes", str(nodes),
                             "--slots", "4", "--context", "512", "--model", str(gguf_file())],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "serve did not start"
    url = json.loads(line)["url"]
    return {"proc": proc, "url": url, "nodes": nodes, "client": openai.OpenAI(
        base_url=url, api_key="unused", max_retries=0, timeout=300)}


@pytest.fixture(scope="module", params=[1, 3], ids=["one-node", "ring-of-3"])
def served(request: Any) -> Iterator[Dict[str, Any]]:
    server = start(request.param)
    yield server
    server["proc"].terminate()
    server["proc"].wait(30)


def schema_format(schema: Any) -> Dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_json_schema_output_validates_for_20_seeded_samples(served: Dict[str, Any]) -> None:
    client, texts = served["client"], []
    for seed in range(5):  # 4 samples in flight each
        reply = client.chat.completions.create(
            model="m", messages=ASK, n=4, seed=seed, temperature=1.0, max_tokens=120,
            response_format=schema_format(PERSON))
        texts += [(c.message.content, c.finish_reason) for c in reply.choices]
    assert len(texts) == 20
    for text, finish in texts:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_an_object(served: Dict[str, Any]) -> None:
    reply = served["client"].chat.completions.create(
        model="m", messages=ASK, temperature=0, max_tokens=60,
        response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize("extra, pattern", [
    ({"grammar": 'root ::= ("yes" | "no") "!"'}, r"^(yes|no)!$"),
    ({"json_schema": {"type": "integer", "minimum": 10, "maximum": 99}}, r"^[1-9][0-9]$"),
])
def test_llama_server_fields_hold_completions(served: Dict[str, Any], extra: Dict[str, Any],
                                             pattern: str) -> None:
    for seed in range(3):
        reply = served["client"].completions.create(
            model="m", prompt="Answer:", max_tokens=20, seed=seed, temperature=1.0,
            extra_body=extra)
        assert re.match(pattern, reply.choices[0].text), reply.choices[0].text


def test_a_streamed_schema_answer_is_the_same(served: Dict[str, Any]) -> None:
    kwargs = dict(model="m", messages=ASK, temperature=0, max_tokens=120, seed=1,
                  response_format=schema_format(PERSON))
    whole = served["client"].chat.completions.create(**kwargs).choices[0].message.content
    stream = served["client"].chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def spec_drafted(url: str) -> float:
    text = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=30).text
    found = re.search(r"^mdiedge_spec_drafted_tokens_total ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_speculation_under_a_schema_keeps_greedy_tokens(served: Dict[str, Any]) -> None:
    """Drafts proposed from the prompt (its JSON has the keys in another order than the
    schema's, so some are outside the grammar and must be rejected): the greedy answer is
    the one decoded without speculation, and valid. On the ring, where a verified row costs
    little, drafts were made; one node's adaptive k may draft none (a row costs it nearly a
    step): ``tests/test_grammar.py`` verifies such drafts directly."""
    asked = [{"role": "user", "content": 'Copy this JSON: {"pets": ["dog", "cat"], "age": '
                                         '41, "name": "Ann Lee"} {"name": "Ann Lee", "age": 41'}]
    kwargs = dict(model="m", messages=asked, temperature=0, max_tokens=60,
                  response_format=schema_format(PERSON))
    drafted = spec_drafted(served["url"])
    plain = served["client"].chat.completions.create(**kwargs, extra_body={"speculate": "off"})
    fast = served["client"].chat.completions.create(**kwargs, extra_body={"speculate": "ngram"})
    assert fast.choices[0].message.content == plain.choices[0].message.content
    jsonschema.validate(json.loads(fast.choices[0].message.content), PERSON)
    assert served["nodes"] == 1 or spec_drafted(served["url"]) > drafted


def test_a_required_tool_call_is_held_to_the_tools(served: Dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}]
    reply = served["client"].chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice="required", temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def deep(depth: int) -> Any:
    schema: Any = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("body, field, message", [
    ({"response_format": schema_format(deep(40))}, "response_format", "nested deeper"),
    ({"response_format": {"type": "xml"}}, "response_format", "expected text, json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "name and a schema"),
    ({"grammar": "root ::= nothing-here"}, "grammar", "grammar: gbnf"),
    ({"grammar": "x", "json_schema": {}}, "json_schema", "not grammar and json_schema"),
    ({"grammar": 5}, "grammar", "a string"),
    ({"cache_prompt": "yes"}, "cache_prompt", "a boolean"),
])
def test_unusable_grammars_are_400s(served: Dict[str, Any], body: Dict[str, Any],
                                    field: Any, message: str) -> None:
    response = httpx.post(served["url"] + "/chat/completions", timeout=60, json=dict(
        body, model="m", messages=ASK, max_tokens=5))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == field, error
    health = httpx.get(served["url"].rsplit("/v1", 1)[0] + "/health", timeout=10)
    assert health.status_code == 200
