"""``mdiedge serve`` as a user runs it: a local ring of three processes behind the OpenAI
API, the key from the environment; a stream that the client drops frees its KV slots on every
node (read from each node's status through /metrics); SIGTERM stops every process."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator

import httpx
import openai
import pytest

KEY = "ring-test-key-42"


@pytest.fixture(scope="module")
def served(stories: Path) -> Iterator[Dict[str, Any]]:
    env = dict(os.environ, MDIEDGE_API_KEY=KEY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mdiedge", "serve", "--port", "0", "--nodes", "3", "--slots", "4",
         "--context", "512", "--model", str(stories / "stories260K.bin"),
         "--tokenizer", str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"serve did not start: {proc.stderr.read() if proc.stderr else ''}")
    ready = json.loads(line)
    yield {"proc": proc, "url": ready["url"], "ready": ready}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def node_slots(url: str) -> Dict[str, float]:
    text = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^mdiedge_node_kv_slots_in_use\{node="([^"]+)",role="[^"]+"\} (\S+)$', text, re.M)}


def test_serve_answers_with_the_key_from_the_environment(served: Dict[str, Any]) -> None:
    assert served["ready"]["model"] == "stories260K" and served["ready"]["slots"] == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served["url"], api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=served["url"], api_key=KEY, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="stories260K", max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "Hello"}])
    assert reply.usage.completion_tokens == 12 and reply.choices[0].message.content


def test_a_dropped_stream_frees_its_slots_on_every_node(served: Dict[str, Any]) -> None:
    body = {"model": "stories260K", "prompt": "Once", "max_tokens": 400, "n": 2, "stream": True}
    with httpx.stream("POST", served["url"] + "/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        held = node_slots(served["url"])
    assert sorted(held) == ["starter", "w1", "w2"] and set(held.values()) == {2.0}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and set(node_slots(served["url"]).values()) != {0.0}:
        time.sleep(0.1)
    assert node_slots(served["url"]) == {"starter": 0.0, "w1": 0.0, "w2": 0.0}


def test_sigterm_stops_the_server_and_its_nodes(served: Dict[str, Any]) -> None:
    proc = served["proc"]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 2  # the two workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    time.sleep(0.5)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]
