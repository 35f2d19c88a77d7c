"""Tool calls read from a model's output (mdiedge/model/toolcalls.py), as table tests: the
Hermes ``<tool_call>`` form and a whole-output JSON call, what is not a call, and a stream
split at every character showing the same content as the finished text, never a piece of a
call."""
from __future__ import annotations

import json
from typing import List, Optional, Tuple

import pytest

from mdiedge.model.toolcalls import ParsedOutput, ToolCall, ToolCallSplitter, parse_tool_calls

NAMES = ("get_weather", "get_time")
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
ROME = ToolCall("get_weather", '{"city": "Rome"}')
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

CALLS: List[Tuple[str, Optional[str], Tuple[ToolCall, ...]]] = [
    (HERMES, None, (PARIS,)),
    ("\n" + HERMES + "\n", None, (PARIS,)),
    ("Let me look.\n" + HERMES, "Let me look.\n", (PARIS,)),
    (HERMES + '\n<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>', None,
     (PARIS, ROME)),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
     None, (PARIS,)),  # arguments as a JSON object's text
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, (ToolCall("get_time", "{}"),)),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, (PARIS,)),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, (PARIS,)),
    ('  {"name": "get_weather", "arguments": {"city": "Paris"}}\n', None, (PARIS,)),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', None,
     (ToolCall("get_weather", '{"city": "Zürich"}'),)),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     None, (PARIS,)),  # Qwen2.5-Coder's greedy answer
    ("```\n" + HERMES + "\n```\n", None, (PARIS,)),
    ("```python\nx = 1\n```\n" + HERMES, "```python\nx = 1\n```\n", (PARIS,)),
]
NOT_CALLS = [
    "The weather is fine.",
    "",
    '<tool_call>{"name": "get_stock", "arguments": {}}</tool_call>',  # not a tool
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # not an object
    '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {}, "x": 1}</tool_call>',
    '<tool_call>["get_weather"]</tool_call>',
    HERMES + " and then some words",  # text after the call
    HERMES + '\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # one bad spoils all
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\nand on',
    '{"name": "get_weather", "arguments": {"city": "Paris"}} trailing',
    'Call: {"name": "get_weather", "arguments": {"city": "Paris"}}',  # JSON not the whole
    '{"city": "Paris"}',
    '```python\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n``` and more',
    '```json\n{"name": "get_weather", "arguments": {}}\n```\n```json\n{}\n```',
    "```json\n```",
    "```",
    "{" * 5000,  # deep or broken JSON is text
    "[" * 100000,
]


@pytest.mark.parametrize("text, content, calls", CALLS)
def test_calls_are_read_with_the_text_before_them(text: str, content: Optional[str],
                                                  calls: Tuple[ToolCall, ...]) -> None:
    assert parse_tool_calls(text, NAMES) == ParsedOutput(content, calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("text", NOT_CALLS)
def test_what_is_not_a_valid_call_is_the_text(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == ParsedOutput(text)


def test_only_the_names_given_are_calls() -> None:
    assert parse_tool_calls(HERMES, ("get_time",)) == ParsedOutput(HERMES)


def split(text: str, size: int) -> Tuple[List[str], str, ParsedOutput]:
    """``text`` pushed ``size`` characters at a time: the pieces shown, and finish's."""
    splitter = ToolCallSplitter()
    shown = [splitter.push(text[i:i + size]) for i in range(0, len(text), size)]
    rest, parsed = splitter.finish(text, NAMES)
    return shown, rest, parsed


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text", [t for t, _, _ in CALLS] + NOT_CALLS[:18]
                         + ["a < b <tool", "x <tool_cal", "<tool_call", "\n\n<t", "``x", "`"])
def test_a_stream_shows_the_content_of_the_whole_text(text: str, size: int) -> None:
    shown, rest, parsed = split(text, size)
    assert parsed == parse_tool_calls(text, NAMES)
    assert "".join(shown) + rest == (parsed.content or "")


@pytest.mark.parametrize("text, before", [
    ("Sure, checking.<tool_call>", "Sure, checking."),
    ("It is <b>bold</b> here", "It is <b>bold</b> here"),
    ("Almost <tool_ca", "Almost "),  # may still become a call
    ("  \n", ""),  # a leading blank waits for what follows
    ('  {"name": "get_weather"', ""),  # may be a whole-output call
    ("a {b} c", "a {b} c"),
    ("``", ""),  # may be a fenced call
    ("`x` is a name", "`x` is a name"),
    ("```python\nprint(1)\n```", ""),
])
def test_a_stream_holds_back_only_what_may_be_a_call(text: str, before: str) -> None:
    splitter = ToolCallSplitter()
    assert "".join(splitter.push(c) for c in text) == before
