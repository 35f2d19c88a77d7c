"""The OpenAI API end to end, driven by the official ``openai`` client and plain HTTP: a server
on an in-process engine (stories260K) in this process; continuous batching, streams, stops,
``n``, errors, the key, the queue, disconnects and metrics."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

from mdiedge.model.sampling import SamplingParams
from mdiedge.serving.api.rules import ServeLimits
from mdiedge.serving.api.server import Api, listen
from mdiedge.engine.local import LocalEngine

KEY = "test-key-0123456789"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine(stories: Path) -> LocalEngine:
    return LocalEngine(stories / "stories260K.bin", stories / "tok512.model", stages=2)


@pytest.fixture(scope="module")
def api(engine: LocalEngine) -> Iterator[Api]:
    server = Api(engine, listen("127.0.0.1", 0),
                 ServeLimits(slots=4, context=256, max_waiting=8), name="stories").start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(api: Api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def texts(response: Any) -> List[str]:
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def streamed(chunks: Any, chat: bool = False) -> Dict[int, Dict[str, Any]]:
    """Each choice's joined text and finish reason from a stream of chunks."""
    out: Dict[int, Dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            slot = out.setdefault(c.index, {"text": "", "finish_reason": None})
            slot["text"] += (c.delta.content or "") if chat else c.text
            slot["finish_reason"] = c.finish_reason or slot["finish_reason"]
    return out


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["stories"]
    assert client.models.retrieve("stories").owned_by == "mdiedge"
    assert client.models.retrieve("gpt-4").id == "gpt-4"  # one model, served under any name


def test_a_greedy_completion_is_the_engines_text(client: openai.OpenAI,
                                                 engine: LocalEngine) -> None:
    alone = engine.generate("Once upon a time", 24, 1, SamplingParams(temperature=0))
    response = client.completions.create(model="stories", prompt="Once upon a time",
                                         max_tokens=24, **GREEDY)
    assert texts(response) == [alone.samples[0]["text"]]
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == \
        (len(alone.prompt_ids), 24)


def test_a_stream_gives_the_same_text_as_a_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="stories", prompt="The dog", max_tokens=30,
                                      seed=4, temperature=0.9)
    chunks = list(client.completions.create(model="stories", prompt="The dog", max_tokens=30,
                                            seed=4, temperature=0.9, stream=True))
    assert streamed(chunks) == {0: {"text": texts(whole)[0], "finish_reason": "length"}}


def test_chat_streams_the_role_first_then_text_and_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="stories", messages=messages, max_tokens=20,
                                           **GREEDY)
    chunks = list(client.chat.completions.create(
        model="stories", messages=messages, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert streamed(chunks, chat=True)[0]["text"] == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 5  # the template's


def test_n_samples_have_their_own_streams_and_repeat_with_a_seed(client: openai.OpenAI) -> None:
    args = dict(model="stories", prompt="Lily", max_tokens=16, n=3, seed=11, temperature=1.0)
    first, again = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts(first) == texts(again) and len(set(texts(first))) > 1
    chunks = streamed(client.completions.create(stream=True, **args))
    assert [chunks[i]["text"] for i in range(3)] == texts(first)
    assert first.usage.completion_tokens == 48


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    full = texts(client.completions.create(model="stories", prompt="Once upon a time",
                                           max_tokens=40, **GREEDY))[0]
    stop = full[12:16]
    cut = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=40,
                                    stop=[stop, "zzz"], **GREEDY)
    assert texts(cut) == [full[:full.index(stop)]] and cut.choices[0].finish_reason == "stop"
    chunks = streamed(client.completions.create(model="stories", prompt="Once upon a time",
                                                max_tokens=40, stop=stop, stream=True, **GREEDY))
    assert chunks[0] == {"text": full[:full.index(stop)], "finish_reason": "stop"}


def test_requests_sent_while_others_decode_get_what_each_gets_alone(
        client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The cat", "Tom and Sue", "One day, a big"]
    alone = [texts(client.completions.create(model="stories", prompt=p, max_tokens=30, **GREEDY))
             for p in prompts]
    long = client.completions.create(model="stories", prompt=prompts[0], max_tokens=120,
                                     stream=True, **GREEDY)
    first = next(iter(long))  # the long one decodes while the others arrive
    got: Dict[int, List[str]] = {}

    def one(i: int) -> None:
        got[i] = texts(client.completions.create(model="stories", prompt=prompts[i],
                                                 max_tokens=30, **GREEDY))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    rest = first.choices[0].text + streamed(long)[0]["text"]
    assert [got[i] for i in range(len(prompts))] == alone
    assert rest.startswith(alone[0][0])  # the long one, too, is what it is alone


@pytest.mark.parametrize("args, error, match", [
    ({"max_tokens": 10_000}, openai.BadRequestError, "exceeds the context of 256"),
    ({"n": 5}, openai.BadRequestError, "at most 4 samples"),
    ({"extra_body": {"bogus": 1}}, openai.BadRequestError, "bogus: unknown field"),
    ({"max_tokens": "7"}, openai.BadRequestError, "expected an integer, got '7'"),
    ({"stop": [""]}, openai.BadRequestError, "stop: expected non-empty strings"),
    ({"top_p": 0}, openai.BadRequestError, r"top_p: expected a number in \(0, 1\]"),
])
def test_errors_have_openais_shape_and_status(client: openai.OpenAI, args: Dict[str, Any],
                                              error: type, match: str) -> None:
    args = dict({"model": "stories", "prompt": "x", "max_tokens": 4}, **args)
    with pytest.raises(error, match=match) as caught:
        client.completions.create(**args)
    assert caught.value.body["type"] == "invalid_request_error"


def test_sse_framing_over_plain_http(api: Api) -> None:
    body = {"model": "stories", "prompt": "Once", "max_tokens": 6, "stream": True, **GREEDY}
    with httpx.stream("POST", api.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    assert len(events) == 2 + 6 + 1  # [DONE], "", six tokens (at most), the finish chunk


def test_unknown_routes_and_bad_bodies_are_openai_errors(api: Api) -> None:
    missing = httpx.get(api.url + "/v1/engines", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for content, status in ((b"{nope", 400), (b"[1]", 400)):
        bad = httpx.post(api.url + "/v1/completions", content=content, timeout=10)
        assert bad.status_code == status and "body:" in bad.json()["error"]["message"]


def test_a_client_that_goes_away_frees_its_slots(api: Api, engine: LocalEngine) -> None:
    body = {"model": "stories", "prompt": "Once", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", api.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert api.service.slots_in_use() == 1
        assert [s.slots_in_use for s in engine.stages] == [1, 1]
    deadline = time.monotonic() + 20
    while api.service.counts() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.scheduler.drain()
    assert [s.slots_in_use for s in engine.stages] == [0, 0]
    metrics = httpx.get(api.url + "/metrics", timeout=10).text
    assert 'mdiedge_request_success_total{finished_reason="cancelled"} 1.0' in metrics


def test_metrics_count_tokens_and_time_requests(api: Api, client: openai.OpenAI) -> None:
    def value(text: str, name: str) -> float:
        return float(next(line for line in text.splitlines()
                          if line.startswith(name + " ")).split()[-1])

    before = httpx.get(api.url + "/metrics", timeout=10).text
    client.completions.create(model="stories", prompt="Once", max_tokens=9, **GREEDY)
    after = httpx.get(api.url + "/metrics", timeout=10)
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text
    assert value(text, "mdiedge_generation_tokens_total") - \
        value(before, "mdiedge_generation_tokens_total") == 9
    assert value(text, "mdiedge_time_to_first_token_seconds_count") == \
        value(before, "mdiedge_time_to_first_token_seconds_count") + 1
    for name in ("mdiedge_num_requests_running 0.0", "mdiedge_num_requests_waiting 0.0",
                 "mdiedge_kv_slots_total 4.0", "mdiedge_kv_slots_in_use 0.0",
                 "mdiedge_prompt_tokens_total", "mdiedge_inter_token_latency_seconds_bucket",
                 "mdiedge_e2e_request_latency_seconds_sum", 'mdiedge_requests_total{code="200"}',
                 'mdiedge_node_up{node="local",role="starter"} 1.0',
                 'mdiedge_node_layers{node="local",role="starter"} 5.0'):
        assert name in text


@pytest.fixture(scope="module")
def strict(engine: LocalEngine) -> Iterator[Api]:
    """One slot, no queue, a key, small bodies (its own engine: the layout differs)."""
    own = LocalEngine(engine.path, engine.path.parent / "tok512.model")
    server = Api(own, listen("127.0.0.1", 0), ServeLimits(slots=1, context=128, max_waiting=0,
                                                          max_body=2048), api_key=KEY).start()
    yield server
    server.close()


def test_the_key_the_queue_and_the_body_limit(strict: Api) -> None:
    keyless = openai.OpenAI(base_url=strict.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        keyless.models.list()
    assert httpx.get(strict.url + "/health", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=strict.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = client.completions.create(model="stories260K", prompt="Once", max_tokens=100,
                                       stream=True)
    next(iter(stream))  # it holds the one slot
    with pytest.raises(openai.RateLimitError, match="waiting") as caught:
        client.completions.create(model="stories260K", prompt="Once", max_tokens=4)
    assert int(caught.value.response.headers["retry-after"]) >= 1
    stream.close()
    big = httpx.post(strict.url + "/v1/completions", json={"prompt": "x" * 4000},
                     headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert big.status_code == 413 and "2048" in big.json()["error"]["message"]


def test_chat_renders_the_models_own_template(ring_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "templated"
    shutil.copytree(ring_model, folder)
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}fox"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                              "bos_token": "<s>"}))
    own = LocalEngine(folder)
    server = Api(own, listen("127.0.0.1", 0), ServeLimits(slots=2, context=128)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="templated", max_tokens=5, temperature=0,
            messages=[{"role": "user", "content": "hello ring"}])
        text = "user: hello ring fox"  # the BOS text dropped: the engine adds BOS as an id
        plain = client.completions.create(model="templated", prompt=text, max_tokens=5,
                                          temperature=0)
        assert chat.usage.prompt_tokens == len(own.encode_prompt(text))
        assert chat.choices[0].message.content == plain.choices[0].text
    finally:
        server.close()


def test_uvicorns_lines_take_the_format_of_a_process_that_set_up_logging() -> None:
    """As in `mdiedge starter --api-port`: every line on stderr, uvicorn's included, is the
    process's own format (no `INFO:     Started server process`)."""
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "logging.basicConfig(level='INFO', stream=sys.stderr,\n"
        "                    format='LINE %(levelname)s %(message)s')\n"
        "from mdiedge.serving.api.server import ApiServer, listen\n"
        "async def app(scope, receive, send): pass\n"
        "ApiServer(app, listen('127.0.0.1', 0), 'info').start().stop()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == 0 and any("Started server process" in line for line in lines)
    assert all(line.startswith("LINE ") for line in lines), lines
