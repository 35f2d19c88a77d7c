"""A prompt is tokenized once per request: on ``mdiedge generate`` (one process and a local
ring, streamed and as JSON), on ``mdiedge chat --message`` and on the API (completions and chat,
streamed and not, through the official ``openai`` client). Every tokenizer the engine opens is
wrapped to count its ``encode``/``encode_prompt`` calls on a text that holds the prompt."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator, List

import openai
import pytest
from typer.testing import CliRunner

from storiesapi import stories_args, stories_client

MARK = "Once upon a time Lily"


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The texts holding ``MARK`` that a tokenizer opened from now on encoded (a call inside
    another, ``encode_prompt`` calling ``encode``, counts once)."""
    import torch

    import mdiedge.engine.engine as facade

    seen: List[str] = []
    real_load = facade.load_tokenizer

    def load(*args: Any, **kwargs: Any) -> Any:
        tokenizer = real_load(*args, **kwargs)
        depth = threading.local()
        for name in ("encode", "encode_prompt"):
            real = getattr(tokenizer, name)

            def counted(text: str, _real: Any = real) -> Any:
                outer = not getattr(depth, "n", 0)
                if outer and MARK in text:
                    seen.append(text)
                depth.n = getattr(depth, "n", 0) + 1
                try:
                    return _real(text)
                finally:
                    depth.n -= 1

            setattr(tokenizer, name, counted)
        return tokenizer

    monkeypatch.setattr(facade, "load_tokenizer", load)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # a local ring's: not ours
    return seen


@pytest.mark.parametrize("nodes,as_json", [("1", False), ("1", True), ("2", False)])
def test_generate_tokenizes_the_prompt_once(stories: Path, tokenized: List[str], nodes: str,
                                            as_json: bool) -> None:
    from mdiedge.cli import app

    args = ["generate", MARK, "-n", "4", "--temperature", "0", "--nodes", nodes,
            *stories_args(stories)] + (["--json"] if as_json else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    if as_json:
        assert json.loads(result.stdout.strip().splitlines()[-1])["prompt"] == MARK
    else:
        assert result.stdout.startswith(MARK)
    assert tokenized == [MARK]


def test_chat_tokenizes_the_conversation_once(stories: Path, tokenized: List[str]) -> None:
    from mdiedge.cli import app

    result = CliRunner().invoke(app, ["chat", "-m", MARK, "-n", "4", "--temperature", "0",
                                      *stories_args(stories)])
    assert result.exit_code == 0, result.output
    assert len(tokenized) == 1, tokenized


@pytest.fixture
def client(stories: Path, tokenized: List[str]) -> Iterator[openai.OpenAI]:
    with stories_client(stories) as client:
        yield client


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_the_api_tokenizes_a_prompt_once(client: openai.OpenAI, tokenized: List[str],
                                         chat: bool, stream: bool) -> None:
    if chat:
        answer: Any = client.chat.completions.create(
            model="stories", messages=[{"role": "user", "content": MARK}], max_tokens=4,
            temperature=0, stream=stream)
    else:
        answer = client.completions.create(model="stories", prompt=MARK, max_tokens=4,
                                           temperature=0, stream=stream)
    if stream:
        chunks = list(answer)
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
    else:
        assert answer.choices[0].finish_reason == "length"
    assert len(tokenized) == 1, tokenized
    assert (MARK in tokenized[0]) and (chat or tokenized[0] == MARK)
