"""What OpenAI's clients send beyond the basics, through real ``mdiedge serve`` processes and
the official ``openai`` client: logprobs (chat and completions, whole and streamed) equal to
the log-softmax of the model's logits computed here with the library; penalties,
``logit_bias``, ``min_p`` and ``top_k`` changing greedy output as OpenAI and llama.cpp define
them (checked against a decoding loop written here); fields OpenAI accepts and ignores; every
body error a 400; any model name (``--strict-model-name``: 404); ``system_fingerprint``;
CORS (``--cors-origins``) and the ``X-Api-Key`` header."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import httpx
import openai
import pytest
import torch

from commands import MDIEDGE

KEY = "options-test-key-42"
ORIGIN = "https://app.example.com"
PROMPT = "Once upon a time"
GREEDY = {"temperature": 0}
N = 14  # new tokens per request


def start_serve(stories: Path, *extra: str) -> Tuple[subprocess.Popen, Dict[str, Any]]:
    env = dict(os.environ, MDIEDGE_API_KEY=KEY)
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--slots", "4", "--context", "256",
         "--model", str(stories / "stories260K.bin"), "--tokenizer",
         str(stories / "tok512.model"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"serve did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, json.loads(line)


@pytest.fixture(scope="module")
def served(stories: Path) -> Iterator[Dict[str, Any]]:
    """A ring of two behind the API, two origins allowed."""
    proc, ready = start_serve(stories, "--nodes", "2", "--cors-origins",
                              f"{ORIGIN}, http://localhost:5173")
    yield ready
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def client(served: Dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served["url"], api_key=KEY, max_retries=0, timeout=120)


class Reference:
    """stories260K run here, with the library, over whole sequences: its logits, and greedy
    decoding with the penalties written out as OpenAI and llama.cpp define them."""

    def __init__(self, stories: Path) -> None:
        from mdiedge.model.checkpoint import load_model
        from mdiedge.model.tokenizer import load_tokenizer

        self.model = load_model(stories / "stories260K.bin")
        self.tokenizer = load_tokenizer(stories / "stories260K.bin", stories / "tok512.model")
        self.eos = set(self.model.cfg.eos_ids)

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """(len(ids), vocab): the logits after each prefix of ``ids``."""
        self.model.setup_cache(1, len(ids))
        return self.model(torch.tensor([list(ids)]), torch.tensor([0]), [0],
                          all_logits=True)[0].float()

    def logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """The log-softmax rows that chose each of ``tokens`` after ``prompt``."""
        rows = self.logits(list(prompt) + list(tokens))[len(prompt) - 1:-1]
        return torch.log_softmax(rows, dim=-1)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], n: int, presence: float = 0.0,
               frequency: float = 0.0, repetition: float = 1.0,
               bias: Optional[Dict[int, float]] = None) -> List[int]:
        out: List[int] = []
        self.model.setup_cache(1, len(prompt) + n)
        row = self.model(torch.tensor([list(prompt)]), torch.tensor([0]), [0])[0].float()
        while len(out) < n:
            if out:  # the last token fed through the KV cache
                row = self.model(torch.tensor([out[-1:]]), torch.tensor([0]),
                                 [len(prompt) + len(out) - 1])[0].float()
            row = row.clone()
            for token, value in (bias or {}).items():
                row[token] += value
            for token in set(prompt) | set(out):
                row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
            for token in set(out):
                row[token] -= out.count(token) * frequency + presence
            token = int(row.argmax())
            if token in self.eos:
                break
            out.append(token)
        return out

    def text(self, prompt: Sequence[int], tokens: Sequence[int]) -> str:
        whole = self.tokenizer.decode(list(prompt) + list(tokens))
        return whole[len(self.tokenizer.decode(prompt)):]


@pytest.fixture(scope="module")
def reference(stories: Path) -> Reference:
    return Reference(stories)


def completion(client: openai.OpenAI, **args: Any) -> Any:
    return client.completions.create(**dict(dict(model="stories260K", prompt=PROMPT,
                                                 max_tokens=N, **GREEDY), **args))


# ------------------------------------------------------------------ logprobs


def test_completion_logprobs_are_the_models_log_softmax(client: openai.OpenAI,
                                                        reference: Reference) -> None:
    prompt = reference.tokenizer.encode_prompt(PROMPT)
    want = reference.greedy(prompt, N)
    reply = completion(client, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == reference.text(prompt, want)
    assert "".join(logprobs.tokens) == reply.choices[0].text and len(logprobs.tokens) == N
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(N)]
    rows = reference.logprobs(prompt, want)
    for i, token in enumerate(want):
        assert logprobs.token_logprobs[i] == pytest.approx(float(rows[i, token]), abs=1e-4)
        best = torch.topk(rows[i], 3)
        assert sorted(logprobs.top_logprobs[i].values(), reverse=True) == \
            pytest.approx(best.values.tolist(), abs=1e-4)
        assert set(logprobs.top_logprobs[i]) == {
            reference.text(prompt + want[:i], [t]) for t in best.indices.tolist()}
    streamed: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in completion(client, logprobs=3, stream=True):
        for c in chunk.choices:
            for key in streamed:
                streamed[key] += getattr(c.logprobs, key) if c.logprobs else []
    assert streamed == {k: getattr(logprobs, k) for k in streamed}


def test_chat_logprobs_are_the_models_log_softmax(client: openai.OpenAI,
                                                  reference: Reference, stories: Path) -> None:
    from mdiedge.serving.api.chat import ChatTemplate
    from mdiedge.serving.api.schema import ChatMessage

    template = ChatTemplate.for_model(stories / "stories260K.bin", reference.tokenizer)
    prompt = reference.tokenizer.encode(template.render([ChatMessage("user", "Tell a story")]))
    args = dict(model="stories260K", messages=[{"role": "user", "content": "Tell a story"}],
                max_tokens=N, logprobs=True, top_logprobs=4, stop=["\nUSER:"], **GREEDY)
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    tokens = reference.greedy(prompt, len(content))
    rows = reference.logprobs(prompt, tokens)
    assert "".join(c.token for c in content).startswith(reply.choices[0].message.content)
    for i, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(rows[i, tokens[i]]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [t.logprob for t in entry.top_logprobs] == \
            pytest.approx(torch.topk(rows[i], 4).values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert all(c.system_fingerprint == reply.system_fingerprint for c in chunks)
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # the prompt cache may
    assert [e.logprob for e in streamed] == pytest.approx(  # round the rows it reused apart
        [e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**dict(args, logprobs=False, top_logprobs=None))
    assert plain.choices[0].logprobs is None


# ------------------------------------------------------------------ sampling options

PENALTIES = [  # (request fields, the reference's arguments, differs from plain greedy)
    ({"frequency_penalty": 2.0}, {"frequency": 2.0}, True),
    ({"presence_penalty": 2.0}, {"presence": 2.0}, True),
    ({"presence_penalty": -2.0, "frequency_penalty": 0.5}, {"presence": -2.0, "frequency": 0.5},
     None),
    ({"repetition_penalty": 1.8}, {"repetition": 1.8}, True),
    ({"repeat_penalty": 1.8}, {"repetition": 1.8}, True),  # llama.cpp's name
    ({"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1}, {}, False),
]


@pytest.mark.parametrize("fields, args, differs", PENALTIES)
def test_penalties_change_greedy_output_as_defined(client: openai.OpenAI, reference: Reference,
                                                   fields: Dict[str, Any], args: Dict[str, Any],
                                                   differs: Optional[bool]) -> None:
    prompt, n = reference.tokenizer.encode_prompt(PROMPT), 48  # long enough to repeat
    want = reference.text(prompt, reference.greedy(prompt, n, **args))
    got = completion(client, max_tokens=n, extra_body=fields).choices[0].text
    assert got == want
    if differs is not None:
        assert (got != reference.text(prompt, reference.greedy(prompt, n))) is differs


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, reference: Reference) -> None:
    prompt = reference.tokenizer.encode_prompt(PROMPT)
    plain = reference.greedy(prompt, N)
    banned = completion(client, logit_bias={str(plain[0]): -100}).choices[0].text
    assert banned == reference.text(prompt, reference.greedy(prompt, N, bias={plain[0]: -100}))
    assert not banned.startswith(reference.text(prompt, plain[:1]))
    forced = reference.tokenizer.encode(" dog")[-1]
    for args in (GREEDY, {"temperature": 1.0, "seed": 5}):  # sampled too: +100 leaves no other
        text = completion(client, logit_bias={str(forced): 100}, max_tokens=5,
                          **args).choices[0].text
        assert text == reference.text(prompt, [forced] * 5)
    chat = client.chat.completions.create(model="x", max_tokens=3, logit_bias={forced: 100},
                                          messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert chat.choices[0].message.content.strip() == \
        reference.text(prompt, [forced] * 3).strip()
    with pytest.raises(openai.BadRequestError, match="token id 99999 is not in the model's"):
        completion(client, logit_bias={"99999": 5})


@pytest.mark.parametrize("fields", [{"min_p": 1.0}, {"top_k": 1}])
def test_filters_that_leave_the_likeliest_token_sample_as_greedy(
        client: openai.OpenAI, fields: Dict[str, Any]) -> None:
    greedy = completion(client).choices[0].text
    sampled = completion(client, temperature=1.0, seed=3, extra_body=fields).choices[0].text
    assert sampled == greedy
    assert any(completion(client, temperature=1.0, seed=seed).choices[0].text != greedy
               for seed in (3, 4, 5))  # unfiltered, sampling leaves greedy text somewhere


def test_stop_takes_up_to_16_strings(client: openai.OpenAI) -> None:
    stops = [f"zz{i}" for i in range(15)] + [" upon"]
    assert completion(client, prompt="Once", stop=stops).choices[0].finish_reason in (
        "stop", "length")
    with pytest.raises(openai.BadRequestError, match="stop: at most 16 strings, got 17"):
        completion(client, stop=stops + ["x"])


# ------------------------------------------------------------------ lenient where OpenAI is


def test_fields_openai_accepts_are_ignored_and_any_model_name_is_served(
        client: openai.OpenAI, served: Dict[str, Any]) -> None:
    reply = client.chat.completions.create(
        model="gpt-3.5-turbo", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        store=True, metadata={"run": "1"}, service_tier="auto", user="u-1",
        reasoning_effort="low", stream_options=None, extra_body={"modalities": ["text"]},
        **GREEDY)
    assert reply.model == served["model"] and reply.choices[0].message.content
    assert reply.system_fingerprint.startswith("fp_")
    again = completion(client, model="text-davinci-003")
    assert again.system_fingerprint == reply.system_fingerprint
    assert client.models.retrieve("gpt-4o").id == "gpt-4o"
    chunks = list(completion(client, stream=True, stream_options={"include_usage": True},
                             extra_body={"stream_options": {"include_usage": True,
                                                            "include_obfuscation": False}}))
    assert chunks and all(c.system_fingerprint == reply.system_fingerprint for c in chunks)


@pytest.mark.parametrize("args, param, match", [
    ({"extra_body": {"bogus": 1}}, "bogus", "bogus: unknown field"),
    ({"max_tokens": "7"}, "max_tokens", "expected an integer, got '7'"),
    ({"extra_body": {"presence_penalty": "high"}}, "presence_penalty", "expected a number"),
    ({"frequency_penalty": 3}, "frequency_penalty", r"expected a number in \[-2, 2\], got 3"),
    ({"logprobs": 21}, "logprobs", r"expected an integer in \[0, 20\], got 21"),
    ({"suffix": "and so on"}, "suffix", "not supported by this server"),
    ({"best_of": 2, "n": 3}, "best_of", "expected at least n"),
])
def test_every_body_error_is_a_400_in_openais_shape(client: openai.OpenAI, args: Dict[str, Any],
                                                    param: str, match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        completion(client, **args)
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "invalid_request_error" and \
        caught.value.body["param"] == param


def test_a_strict_server_refuses_other_model_names_and_any_origin_is_allowed(
        stories: Path) -> None:
    proc, ready = start_serve(stories, "--nodes", "1", "--strict-model-name",
                              "--cors-origins", "*")
    try:
        strict = openai.OpenAI(base_url=ready["url"], api_key=KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4' not found"):
            completion(strict, model="gpt-4")
        assert completion(strict).choices[0].text
        answer = httpx.get(ready["url"] + "/models", headers={"Origin": "http://any.where",
                                                              "X-Api-Key": KEY}, timeout=30)
        assert answer.status_code == 200 and \
            answer.headers["access-control-allow-origin"] == "*"
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ CORS and X-Api-Key


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(
        served: Dict[str, Any]) -> None:
    url = served["url"] + "/chat/completions"
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    answer = httpx.options(url, headers=dict(ask, Origin=ORIGIN), timeout=30)
    assert answer.status_code == 204
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-allow-headers"] == "authorization, content-type"
    other = httpx.options(url, headers=dict(ask, Origin="https://evil.example"), timeout=30)
    assert other.status_code != 204
    assert not any(h.startswith("access-control-") for h in other.headers)


def test_responses_carry_the_allowed_origin_only(served: Dict[str, Any]) -> None:
    url = served["url"] + "/completions"
    body = {"model": "m", "prompt": "Once", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    ok = httpx.post(url, json=body, headers=dict(auth, Origin=ORIGIN), timeout=60)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.post(url, json=body, headers={"Origin": "http://localhost:5173"}, timeout=60)
    assert refused.status_code == 401  # without the key: refused, readable by the page
    assert refused.headers["access-control-allow-origin"] == "http://localhost:5173"
    other = httpx.post(url, json=body, headers=dict(auth, Origin="https://evil.example"),
                       timeout=60)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in httpx.post(url, json=body, headers=auth,
                                                           timeout=60).headers


def test_the_key_may_come_in_x_api_key(served: Dict[str, Any]) -> None:
    url = served["url"] + "/models"
    assert httpx.get(url, headers={"X-Api-Key": KEY}, timeout=30).status_code == 200
    wrong = httpx.get(url, headers={"X-Api-Key": "nope"}, timeout=30)
    assert wrong.status_code == 401 and "X-Api-Key" in wrong.json()["error"]["message"]
    assert httpx.get(url, timeout=30).status_code == 401


@pytest.mark.parametrize("origins", ["ftp://x.example", "https://a.example/path", "app.example"])
def test_a_bad_cors_origin_is_a_usage_error(origins: str) -> None:
    done = subprocess.run([*MDIEDGE, "serve", "--port", "0", "--cors-origins", origins],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and repr(origins) in done.stderr
