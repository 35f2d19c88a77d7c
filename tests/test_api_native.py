"""llama-server's native routes on a real ``mdiedge serve`` of stories260K: ``/completion``
(text or token ids, llama-server's fields and reply, its stream, ``n_probs``,
``ignore_eos``, ``logit_bias`` pairs), ``/tokenize`` (with pieces), ``/detokenize``,
``/apply-template``, ``/props``, ``/slots``; the same text as the OpenAI route for the same
request."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest

from commands import MDIEDGE

KEY = "native-key-0123456789"


@pytest.fixture(scope="module")
def base(stories: Path) -> Iterator[str]:
    """A real ``mdiedge serve`` of stories260K (2 slots of 256 tokens) with an API key."""
    env = dict(os.environ, MDIEDGE_API_KEY=KEY)
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "1", "--slots", "2", "--context", "256",
         "--model-name", "stories", "--model", str(stories / "stories260K.bin"),
         "--tokenizer", str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "serve did not start"
    yield json.loads(line)["url"].rsplit("/v1", 1)[0]
    proc.terminate()
    proc.wait(30)


def post(base: str, path: str, body: Dict[str, Any], status: int = 200) -> Any:
    response = httpx.post(base + path, json=body, timeout=120, headers={"X-Api-Key": KEY})
    assert response.status_code == status, response.text
    return response.json()


def test_completion_is_the_openai_routes_text(base: str) -> None:
    native = post(base, "/completion", {"prompt": "Once upon a time", "n_predict": 16,
                                        "temperature": 0, "seed": 3})
    openai = post(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16,
                                            "temperature": 0, "seed": 3})
    assert native["content"] == openai["choices"][0]["text"]
    assert native["stop"] is True and native["tokens_predicted"] == 16
    assert native["stop_type"] == "limit" and native["stopped_limit"] is True
    assert native["tokens_evaluated"] == openai["usage"]["prompt_tokens"]
    assert native["timings"]["predicted_n"] == 16 and native["timings"]["prompt_ms"] >= 0


def test_a_prompt_of_token_ids_is_the_same_prompt(base: str) -> None:
    ids = post(base, "/tokenize", {"content": "Once upon a time", "add_special": True})["tokens"]
    by_ids = post(base, "/completion", {"prompt": ids, "n_predict": 8, "temperature": 0})
    by_text = post(base, "/completion", {"prompt": "Once upon a time", "n_predict": 8,
                                         "temperature": 0})
    assert by_ids["content"] == by_text["content"]
    openai = post(base, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0})
    assert openai["choices"][0]["text"] == by_text["content"]
    post(base, "/completion", {"prompt": [1, 99999]}, 400)


def test_the_stream_joins_to_the_whole_answer(base: str) -> None:
    body = {"prompt": "The cat", "n_predict": 12, "temperature": 0}
    whole = post(base, "/completion", body)["content"]
    events: List[Dict[str, Any]] = []
    with httpx.stream("POST", base + "/completion", json=dict(body, stream=True), timeout=120,
                      headers={"X-Api-Key": KEY}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert "".join(e["content"] for e in events) == whole
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    assert events[-1]["tokens_predicted"] == 12


def test_n_probs_ignore_eos_and_bias_pairs(base: str) -> None:
    out = post(base, "/completion", {"prompt": "The cat", "n_predict": 4, "temperature": 0,
                                     "n_probs": 3})
    probs = out["completion_probabilities"]
    assert len(probs) == 4 and all(len(p["top_logprobs"]) == 3 for p in probs)
    assert all(p["top_logprobs"][0]["id"] == p["id"] for p in probs)  # greedy: the likeliest
    banned = probs[0]["id"]
    out = post(base, "/completion", {"prompt": "The cat", "n_predict": 4, "temperature": 0,
                                     "n_probs": 1, "logit_bias": [[banned, False]]})
    assert out["completion_probabilities"][0]["id"] != banned
    long = post(base, "/completion", {"prompt": "The end.", "n_predict": 200,
                                      "temperature": 0, "ignore_eos": True})
    assert long["tokens_predicted"] == 200 and long["stopped_eos"] is False


def test_tokenize_detokenize_and_pieces(base: str) -> None:
    ids = post(base, "/tokenize", {"content": "Hello there"})["tokens"]
    assert post(base, "/detokenize", {"tokens": ids})["content"].strip() == "Hello there"
    pieces = post(base, "/tokenize", {"content": "Hello there", "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids and all(isinstance(p["piece"], str) for p in pieces)
    assert post(base, "/detokenize", {"tokens": []})["content"] == ""
    post(base, "/detokenize", {"tokens": "x"}, 400)
    post(base, "/tokenize", {"content": 5}, 400)


def test_apply_template_and_props(base: str) -> None:
    prompt = post(base, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})
    assert "USER:\nHi" in prompt["prompt"] and prompt["prompt"].endswith("ASSISTANT:\n")
    props = httpx.get(base + "/props", headers={"X-Api-Key": KEY}, timeout=30).json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 256
    assert props["model_alias"] == "stories" and props["build_info"].startswith("mdiedge ")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "bogus": 1}, "unknown field 'bogus'"),
    ({"n_predict": 3}, "prompt: required"),
    ({"prompt": "x", "logit_bias": 5}, "logit_bias"),
    ({"prompt": ["a", "b"]}, "one prompt here, got 2"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
])
def test_bad_native_bodies_are_400s(base: str, body: Dict[str, Any], message: str) -> None:
    assert message in post(base, "/completion", body, 400)["error"]["message"]


def test_fields_with_no_meaning_here_are_ignored(base: str) -> None:
    out = post(base, "/completion", {"prompt": "x", "n_predict": 2, "mirostat": 0,
                                     "typical_p": 1.0, "n_keep": 0, "id_slot": -1,
                                     "cache_prompt": True, "seed": -1})
    assert out["tokens_predicted"] <= 2


def test_the_key_is_needed(base: str) -> None:
    assert httpx.post(base + "/completion", json={"prompt": "x"}, timeout=30).status_code == 401


def busy_slots(base: str, body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The busy slots ``/slots`` shows first while ``body`` runs (none if it never saw one)."""
    import threading

    headers = {"X-Api-Key": KEY}
    done = threading.Event()
    worker = threading.Thread(target=lambda: (post(base, "/completion", body), done.set()))
    worker.start()
    try:
        while not done.is_set():
            slots = httpx.get(base + "/slots", headers=headers, timeout=30).json()
            busy = [s for s in slots if s["is_processing"]]
            if busy:
                assert len(slots) == 2
                return busy
        return []
    finally:
        worker.join()


def test_slots_show_the_sample_running_then_idle(base: str) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 240, "temperature": 0,
            "ignore_eos": True}
    busy = next(filter(None, (busy_slots(base, body) for _ in range(10))), [])
    assert len(busy) == 1 and busy[0]["id_task"] > 0, busy
    assert busy[0]["params"]["n_predict"] == 240 and busy[0]["n_ctx"] == 256
    assert busy[0]["next_token"]["n_decoded"] < 240 and "prompt" not in busy[0]
    slots = httpx.get(base + "/slots", headers={"X-Api-Key": KEY}, timeout=30).json()
    assert not any(s["is_processing"] for s in slots)
    assert httpx.get(base + "/slots", timeout=30).status_code == 401
