"""``/v1/completions`` beyond one prompt, through a real ``mdiedge serve`` (a ring of 2 of
stories260K) and the official ``openai`` client: a list of prompts (text or token ids), each
answered as a request of its own would be, choices indexed prompt by prompt; ``echo``; and
``best_of``, whose answer is the likeliest (mean log-probability per token) of the samples a
request with ``n = best_of`` draws from the same seed."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

from commands import MDIEDGE

PROMPTS = ["Once upon a time", "The cat", "Tom and Sue"]
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 12}


@pytest.fixture(scope="module")
def served(stories: Path) -> Iterator[Dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--slots", "6", "--context", "128", "--nodes", "2",
         "--model", str(stories / "stories260K.bin"), "--tokenizer",
         str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "serve did not start"
    ready = json.loads(line)
    yield dict(ready, client=openai.OpenAI(base_url=ready["url"], api_key="x", max_retries=0,
                                           timeout=120))
    proc.kill()
    proc.wait()


def texts(reply: Any) -> List[str]:
    return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]


def test_a_list_of_prompts_answers_each_as_alone(served: Dict[str, Any]) -> None:
    client = served["client"]
    together = client.completions.create(model="m", prompt=PROMPTS, n=2, **SAMPLED)
    alone = [texts(client.completions.create(model="m", prompt=p, n=2, **SAMPLED))
             for p in PROMPTS]
    assert texts(together) == [t for pair in alone for t in pair]
    assert together.usage.prompt_tokens == sum(
        client.completions.create(model="m", prompt=p, max_tokens=1).usage.prompt_tokens
        for p in PROMPTS)
    streamed: Dict[int, str] = {}
    for chunk in client.completions.create(model="m", prompt=PROMPTS, n=2, stream=True,
                                           **SAMPLED):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == texts(together)


def test_token_id_prompts_answer_as_their_text(served: Dict[str, Any]) -> None:
    base = served["url"].rsplit("/v1", 1)[0]
    ids = [httpx.post(base + "/tokenize", json={"content": p, "add_special": True},
                      timeout=30).json()["tokens"] for p in PROMPTS[:2]]
    client = served["client"]
    by_ids = client.completions.create(model="m", prompt=ids, **SAMPLED)
    by_text = client.completions.create(model="m", prompt=PROMPTS[:2], **SAMPLED)
    assert texts(by_ids) == texts(by_text)


def test_echo_puts_the_prompt_first(served: Dict[str, Any]) -> None:
    client = served["client"]
    plain = texts(client.completions.create(model="m", prompt=PROMPTS[:2], **SAMPLED))
    echoed = client.completions.create(model="m", prompt=PROMPTS[:2], echo=True, **SAMPLED)
    assert texts(echoed) == [p + t for p, t in zip(PROMPTS, plain)]
    streamed: Dict[int, str] = {}
    for chunk in client.completions.create(model="m", prompt=PROMPTS[:2], echo=True,
                                           stream=True, **SAMPLED):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[0], streamed[1]] == texts(echoed)


def mean(logprobs: Any) -> float:
    return sum(logprobs.token_logprobs) / len(logprobs.token_logprobs)


def test_best_of_answers_the_likeliest_sample_drawn(served: Dict[str, Any]) -> None:
    client = served["client"]
    drawn = client.completions.create(model="m", prompt=PROMPTS[0], n=4, logprobs=0, **SAMPLED)
    ranked = sorted(drawn.choices, key=lambda c: mean(c.logprobs), reverse=True)
    assert len({c.text for c in ranked}) > 1, "the seed drew the same text 4 times"
    best = client.completions.create(model="m", prompt=PROMPTS[0], best_of=4, **SAMPLED)
    assert texts(best) == [ranked[0].text] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == drawn.usage.completion_tokens
    two = client.completions.create(model="m", prompt=PROMPTS[0], n=2, best_of=4, logprobs=0,
                                    **SAMPLED)
    assert texts(two) == [c.text for c in ranked[:2]] and two.choices[0].logprobs is not None


def test_more_samples_than_slots_is_a_400(served: Dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError, match="need 8 KV slots, the server has 6"):
        served["client"].completions.create(model="m", prompt=PROMPTS[:2], best_of=4,
                                            max_tokens=2)
