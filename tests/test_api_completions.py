"""``/v1/completions`` beyond one prompt, through a real ``mdiedge serve`` (a ring of 2 of
stories260K, prompts prefilled 8 tokens a message) and the official ``openai`` client: a
list of prompts (text or token ids), each answered as a request of its own would be, choices
indexed prompt by prompt; ``echo``, with the prompt's logprobs equal to the log-softmax of
the model's logits computed here; and
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
import torch

from commands import MDIEDGE

PROMPTS = ["Once upon a time", "The cat", "Tom and Sue"]
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 12}


@pytest.fixture(scope="module")
def served(stories: Path) -> Iterator[Dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--slots", "6", "--context", "128", "--nodes", "2",
         "--prefill-chunk", "8",
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


LONG = "Once upon a time there was a little girl named Lily. She liked to play"


def reference_logprobs(stories: Path, ids: List[int]) -> torch.Tensor:
    """Row p: the log-softmax of stories260K's logits after ids[:p + 1], computed here."""
    from mdiedge.model.checkpoint import load_model

    model = load_model(stories / "stories260K.bin")
    model.setup_cache(1, len(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.tensor([0]), [0], all_logits=True)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt(served: Dict[str, Any], stories: Path) -> None:
    base = served["url"].rsplit("/v1", 1)[0]
    ids = httpx.post(base + "/tokenize", json={"content": LONG, "add_special": True},
                     timeout=30).json()["tokens"]
    assert len(ids) > 16  # three prefill messages
    client = served["client"]
    plain = client.completions.create(model="m", prompt=LONG, logprobs=2, **SAMPLED)
    echoed = client.completions.create(model="m", prompt=LONG, logprobs=2, echo=True, **SAMPLED)
    choice, lp = echoed.choices[0], echoed.choices[0].logprobs
    assert choice.text == LONG + plain.choices[0].text
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + len(
        plain.choices[0].logprobs.tokens)
    rows = reference_logprobs(stories, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - float(rows[p - 1, ids[p]])) < 1e-4, p
        best = torch.topk(rows[p - 1], 2)
        assert sorted(lp.top_logprobs[p].values(), reverse=True) == pytest.approx(
            best.values.tolist(), abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert "".join(lp.tokens[:len(ids)]).strip() == LONG
    assert lp.text_offset[len(ids)] == len(LONG)
    streamed = list(client.completions.create(model="m", prompt=LONG, logprobs=2, echo=True,
                                              stream=True, **SAMPLED))
    first = streamed[0].choices[0]
    assert first.text == LONG and first.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        lp.token_logprobs[1:len(ids)], abs=1e-6)


def test_unseeded_prompts_draw_their_own_samples(served: Dict[str, Any]) -> None:
    reply = served["client"].completions.create(model="m", prompt=[PROMPTS[0]] * 5,
                                                temperature=1.0, max_tokens=24)
    assert len(set(texts(reply))) > 1


def test_a_refused_prompt_of_a_list_frees_the_others(served: Dict[str, Any]) -> None:
    base = served["url"].rsplit("/v1", 1)[0]
    with pytest.raises(openai.BadRequestError, match="exceeds the context of 128"):
        served["client"].completions.create(model="m", prompt=[PROMPTS[0], "Lily " * 200],
                                            max_tokens=100, temperature=0)
    for _ in range(100):
        if not any(s["is_processing"] for s in httpx.get(base + "/slots", timeout=30).json()):
            break
    assert not any(s["is_processing"] for s in httpx.get(base + "/slots", timeout=30).json())


def test_one_process_scores_a_long_prompt_in_slices(stories: Path) -> None:
    """No prefill chunks on one node: the prompt's 100 rows go to the head 64 at a time."""
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--slots", "1", "--context", "128", "--nodes", "1",
         "--model", str(stories / "stories260K.bin"), "--tokenizer",
         str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        prompt = " ".join([LONG] * 6)
        ids = httpx.post(url.rsplit("/v1", 1)[0] + "/tokenize",
                         json={"content": prompt, "add_special": True}, timeout=30).json()["tokens"]
        assert 64 < len(ids) < 120
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        lp = client.completions.create(model="m", prompt=prompt, logprobs=1, echo=True,
                                       max_tokens=1, temperature=0).choices[0].logprobs
        rows = reference_logprobs(stories, ids)
        assert all(abs(lp.token_logprobs[p] - float(rows[p - 1, ids[p]])) < 1e-4
                   for p in range(1, len(ids)))
    finally:
        proc.kill()
        proc.wait()


def test_echoed_entries_lie_over_the_prompt_text_with_an_unshown_special_token() -> None:
    from mdiedge.model.sampling import TokenLogprob
    from mdiedge.model.tokenizer import load_tokenizer
    from mdiedge.serving.api.logprobs import prompt_entries
    from smollm2 import gguf_file

    tokenizer = load_tokenizer(gguf_file())
    text = "Hello world, hi"
    ids = [1] + tokenizer.encode(text)  # <|im_start|>: a special token the text does not show
    entries = prompt_entries(tokenizer, ids, [None] + [TokenLogprob(t, -1.0) for t in ids[1:]],
                             text)
    assert entries[0].text == "" and entries[0].offset == 0 and entries[0].logprob is None
    assert "".join(e.text for e in entries) == text
    assert [e.offset for e in entries] == sorted(e.offset for e in entries)
