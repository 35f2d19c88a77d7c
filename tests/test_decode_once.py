"""Each generated token's text is decoded once per request: one incremental decoder per
sample (``TextOutput``) serves the stop strings, the stream and the final text, so a request
of N tokens makes about N tokenizer decodes, each of a window of a few ids, and none of the
whole output. Counted on ``mdiedge generate`` (streamed, as JSON, with a stop string), on
``mdiedge chat --message``, and on the API (completions and chat, streamed and not, several
samples), through every tokenizer the engine opens."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from storiesapi import stories_args, stories_client

from mdiedge.model.stopping import TextOutput, cut_at_stop
from mdiedge.model.tokenizer import SentencePieceTokenizer, StreamDecoder

PROMPT = "Once upon a time Lily"
N = 30
WINDOW = 2 * StreamDecoder.CONTEXT + 3  # the ids one decode may be given, at most


@pytest.fixture
def sampled(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """The tokens that the samples of requests from now on have, all together."""
    from mdiedge.runtime.generation import Generation

    samples: Dict[int, Any] = {}
    real_take = Generation.take

    def take(self: Any, sample: Any, *args: Any, **kwargs: Any) -> None:
        samples[id(sample)] = sample
        real_take(self, sample, *args, **kwargs)

    monkeypatch.setattr(Generation, "take", take)
    return lambda: sum(len(s.tokens) for s in samples.values())


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch, sampled: Callable[[], int]) -> List[int]:
    """How many ids each decode of a tokenizer opened from now on was given."""
    import torch

    import mdiedge.engine.engine as facade

    lengths: List[int] = []
    real_load = facade.load_tokenizer

    def load(*args: Any, **kwargs: Any) -> Any:
        tokenizer = real_load(*args, **kwargs)
        real = tokenizer.decode

        def counted(ids: Any) -> str:
            lengths.append(len(ids))
            return real(ids)

        tokenizer.decode = counted
        return tokenizer

    monkeypatch.setattr(facade, "load_tokenizer", load)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    return lengths


def once_each(lengths: List[int], tokens: int, samples: int = 1) -> None:
    """About one decode per token (a window's move adds one in ``CONTEXT + 1``; a sample's
    decoder starts with one), none of more than a window: the old code decoded each token
    twice for the stream, twice more for stop strings, and the whole output at the end."""
    assert tokens >= N * samples // 2, "too few tokens to tell"
    assert len(lengths) <= tokens + tokens // (StreamDecoder.CONTEXT + 1) + 2 * samples, lengths
    assert max(lengths) <= WINDOW, lengths


@pytest.mark.parametrize("extra", [[], ["--json"], ["--stop", "zq#"]])
def test_generate_decodes_each_token_once(stories: Path, decoded: List[int],
                                          sampled: Callable[[], int], extra: List[str]) -> None:
    from mdiedge.cli import app

    args = ["generate", PROMPT, "-n", str(N), "--temperature", "0", "--nodes", "1",
            *stories_args(stories), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    if "--json" in extra:
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["samples"][0]["text"] and out["timing"]["new_tokens"] == sampled()
    else:
        assert result.stdout.startswith(PROMPT) and len(result.stdout) > len(PROMPT) + 10
    once_each(decoded, sampled())


def test_chat_decodes_each_token_once(stories: Path, decoded: List[int],
                                      sampled: Callable[[], int]) -> None:
    from mdiedge.cli import app

    result = CliRunner().invoke(app, ["chat", "-m", PROMPT, "-n", str(N), "--temperature",
                                      "0", *stories_args(stories)])
    assert result.exit_code == 0, result.output
    assert len(result.stdout.strip()) > 10
    once_each(decoded, sampled())


@pytest.fixture
def client(stories: Path, decoded: List[int]) -> Iterator[openai.OpenAI]:
    with stories_client(stories) as client:
        yield client


@pytest.mark.parametrize("chat,stream,n", [(False, False, 1), (False, True, 1),
                                           (True, True, 1), (True, False, 2)])
def test_the_api_decodes_each_token_once(client: openai.OpenAI, decoded: List[int],
                                         sampled: Callable[[], int], chat: bool, stream: bool,
                                         n: int) -> None:
    decoded.clear()  # the server's start
    common = dict(model="stories", max_tokens=N, temperature=0.8 if n > 1 else 0, n=n,
                  stream=stream, stop=["zq#"])
    if chat:
        answer: Any = client.chat.completions.create(
            messages=[{"role": "user", "content": PROMPT}], **common,
            **({"stream_options": {"include_usage": True}} if stream else {}))
    else:
        answer = client.completions.create(
            prompt=PROMPT, **common,
            **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(answer)
        texts = [c.choices[0].delta.content if chat else c.choices[0].text
                 for c in chunks if c.choices]
        assert "".join(t or "" for t in texts)
        usage = chunks[-1].usage
    else:
        assert all(c.message.content if chat else c.text for c in answer.choices)
        usage = answer.usage
    assert usage.completion_tokens == sampled()
    once_each(decoded, usage.completion_tokens, n)


STORIES_TOKENIZER = Path(__file__).resolve().parent / "data" / "stories260k" / "tok512.model"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_final_text_is_the_whole_decode(data: st.DataObject) -> None:
    """Random ids (bytes that make no character included): the text made token by token,
    cut at a stop string, is what decoding every id at once reads."""
    if not STORIES_TOKENIZER.is_file():
        pytest.skip(f"{STORIES_TOKENIZER} not here")
    tokenizer = SentencePieceTokenizer(STORIES_TOKENIZER)
    ids = st.one_of(st.integers(0, 8), st.integers(0, 270), st.integers(0, 511))
    prefix = data.draw(st.lists(ids, min_size=1, max_size=12), label="prefix")
    new = data.draw(st.lists(ids, min_size=1, max_size=60), label="new")
    stop = data.draw(st.sampled_from(["e", "th", " a", "zq#"]), label="stop")
    output = TextOutput(tokenizer, prefix, [stop])
    pushed = [output.push(t) for t in new]
    taken = new[:pushed.index(True) + 1] if any(pushed) else new  # a sample ends at its stop
    whole = tokenizer.decode(prefix + taken)[len(tokenizer.decode(prefix)):]
    assert output.final(any(pushed)) == cut_at_stop(whole, [stop])[0]
