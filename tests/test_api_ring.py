"""``mdiedge serve`` as a user runs it: a local ring of three processes behind the OpenAI
API, the key from the environment; a stream that the client drops frees its KV slots on every
node (read from each node's status through /metrics); SIGTERM stops every process."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterator

import httpx
import openai
import pytest
from commands import MDIEDGE

KEY = "ring-test-key-42"


@pytest.fixture(scope="module")
def served(stories: Path) -> Iterator[Dict[str, Any]]:
    env = dict(os.environ, MDIEDGE_API_KEY=KEY)
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "3", "--slots", "4",
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
    kept = node_slots(served["url"])  # rows the prompt cache keeps from earlier requests
    assert sorted(kept) == ["starter", "w1", "w2"] and len(set(kept.values())) == 1
    with httpx.stream("POST", served["url"] + "/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        held = node_slots(served["url"])
    assert held == {name: count + 2 for name, count in kept.items()}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and node_slots(served["url"]) != kept:
        time.sleep(0.1)
    assert node_slots(served["url"]) == kept  # a cancelled sample's rows are not kept


def test_sigterm_stops_the_server_and_its_nodes(served: Dict[str, Any]) -> None:
    proc = served["proc"]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
    assert len(children) == 2  # the two workers
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert time.monotonic() - signalled < 1.5  # about 2.5 s before the quick exit
    time.sleep(0.5)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]


def test_health_says_when_no_worker_answers_and_the_dead_one_is_reaped(stories: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "2", "--slots", "2",
         "--context", "256", "--model", str(stories / "stories260K.bin"),
         "--tokenizer", str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        base = json.loads(proc.stdout.readline())["url"].rsplit("/v1", 1)[0]
        assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}
        worker = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                    text=True).stdout.split()[0])
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        health = httpx.get(base + "/health", timeout=10)
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        assert health.json()["error"].startswith("no worker of the ring answers: w1")
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{worker}")  # reaped: no zombie
    finally:
        proc.terminate()
        proc.wait(20)


def test_the_starter_serves_the_api_beside_its_control_plane(stories: Path,
                                                             tmp_path: Path) -> None:
    env = dict(os.environ, MDIEDGE_SECRET="s3cret-ring-key-0123456789abcdef")
    env.pop("MDIEDGE_API_KEY", None)
    worker = subprocess.Popen([*MDIEDGE, "worker", "--no-config",
                               "--control-port", "0", "--data-port", "0", "--name", "w1",
                               "--log-level", "warning"], stdout=subprocess.PIPE, text=True,
                              env=env)
    starter = None
    try:
        assert worker.stdout is not None
        port = json.loads(worker.stdout.readline())["control_port"]
        ring = tmp_path / "ring.toml"
        ring.write_text(f'[[workers]]\nname = "w1"\nhost = "127.0.0.1"\ncontrol_port = {port}\n')
        starter = subprocess.Popen(
            [*MDIEDGE, "starter", "--config", str(ring), "--control-port",
             "0", "--api-port", "0", "--slots", "2", "--log-level", "warning",
             "--strict-model-name", "--cors-origins", "https://app.example.com",
             "--no-prompt-cache", "--model", str(stories / "stories260K.bin"),
             "--tokenizer", str(stories / "tok512.model")],
            stdout=subprocess.PIPE, text=True, env=env)
        assert starter.stdout is not None
        ready = json.loads(starter.stdout.readline())
        assert ready["control_port"] > 0
        client = openai.OpenAI(base_url=ready["api_url"], api_key="unused", max_retries=0,
                               timeout=60)
        reply = client.completions.create(model="stories260K", prompt="Once", max_tokens=8, n=2)
        assert [len(c.text) > 0 for c in reply.choices] == [True, True]
        with pytest.raises(openai.BadRequestError, match="at most 2 samples"):
            client.completions.create(model="stories260K", prompt="Once", max_tokens=8, n=3)
        assert sorted(node_slots(ready["api_url"])) == ["starter", "w1"]
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4' not found"):
            client.completions.create(model="gpt-4", prompt="Once", max_tokens=2)
        allowed = httpx.options(ready["api_url"] + "/completions", timeout=30, headers={
            "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"})
        assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
        twice = [client.completions.create(model="stories260K", prompt="Once upon a time " * 6,
                                           max_tokens=2) for _ in range(2)]
        assert twice[1].usage.prompt_tokens_details.cached_tokens == 0
    finally:
        for proc in (starter, worker):
            if proc is not None:
                proc.terminate()
                proc.wait(20)


@pytest.mark.parametrize("args, message", [
    (["--slots", "0"], "--slots: expected an integer 1..256, got 0"),
    (["--port", "70000"], "--port: expected a port 0..65535, got 70000"),
    (["--max-queue", "65"], "--max-queue: expected an integer 0..64, got 65"),
    (["--host", "0.0.0.0"], "refusing to serve the API on 0.0.0.0 without an API key"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key: No such file"),
    (["--nodes", "3", "--context", "5000"], "--context: expected 0..1024 tokens (the model's), got 5000"),
    (["--early-exit", "maybe"], "--early-exit: expected one of softmax, similarity, classifier, "
                                "got 'maybe'"),
    (["--exit-threshold", "0.5"], "--exit-threshold: expected given with --early-exit"),
    (["--prefill-chunk", "-2"], "--prefill-chunk: expected an integer >= 0, got -2"),
])
def test_bad_serve_options_are_one_line_errors(args: Any, message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    out = subprocess.run([*MDIEDGE, "serve", *args], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert lines[0].startswith("mdiedge: error: ") and message in lines[0], out.stderr


@pytest.mark.parametrize("command", ["serve", "starter"])
def test_an_api_key_file_others_may_read_is_refused(command: str, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("an-api-key-0123456789\n")
    key.chmod(0o644)
    ring = tmp_path / "ring.toml"
    ring.write_text('[[workers]]\nhost = "127.0.0.1"\ncontrol_port = 1\n')
    args = ["--port", "0"] if command == "serve" else ["--config", str(ring), "--api-port", "0",
                                                        "--control-port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    out = subprocess.run([*MDIEDGE, command, *args, "--api-key-file",
                          str(key)], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert lines[0] == (f"mdiedge: error: --api-key-file {key} (mode 0644) is readable by "
                        f"other users: chmod 600 {key}"), out.stderr


def test_a_port_in_use_is_a_one_line_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([*MDIEDGE, "serve", "--nodes", "3",
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"mdiedge: error: cannot listen on 127.0.0.1:{port}" in out.stderr.strip()


GIB = 1 << 30
SMOLLM2 = dict(blocks=30, kv_heads=3, head_dim=64, itemsize=4, max_context=8192)
WHERE = "for the 30 blocks on this machine (3 nodes)"


@pytest.mark.parametrize("available, slots, context, line", [
    (24 * GIB, None, None, "serve: 8 slots x 4096 tokens, KV cache 1.41 GiB " + WHERE +
     ", 6% of 24.00 GiB available: within 25% of it"),
    (int(2.9 * GIB), None, None, "serve: 4 slots x 4096 tokens, KV cache 720.00 MiB " + WHERE +
     ", 24% of 2.90 GiB available: sized to 25% of it (8 x 4096 would take 1.41 GiB)"),
    (int(2.9 * GIB), 2, None, "serve: 2 slots x 4096 tokens, KV cache 360.00 MiB " + WHERE +
     ", 12% of 2.90 GiB available: within 25% of it"),
    (GIB, 4, None, "serve: 4 slots x 1024 tokens, KV cache 180.00 MiB " + WHERE +
     ", 18% of 1.00 GiB available: sized to 25% of it (4 x 4096 would take 720.00 MiB)"),
    (GIB // 64, None, None, "serve: 1 slot x 512 tokens, KV cache 22.50 MiB " + WHERE +
     ", 141% of 16.00 MiB available: over 25%, the least it sizes to"),
    (GIB // 64, 2, 256, "serve: 2 slots x 256 tokens, KV cache 22.50 MiB " + WHERE +
     ", 141% of 16.00 MiB available (--slots, --context)"),
    (None, None, None, "serve: 8 slots x 4096 tokens, KV cache 1.41 GiB " + WHERE +
     "; available memory unknown: the most (--slots, --context to choose)"),
])
def test_serve_says_what_it_chose_and_why(available: Any, slots: Any, context: Any,
                                          line: str) -> None:
    from mdiedge.cli.serve import shape_line
    from mdiedge.serving.api.rules import KvModel, slot_shape

    model = KvModel(**SMOLLM2)
    assert shape_line(slot_shape(model, available, 30, slots, context), WHERE) == line


def test_serve_decodes_with_early_exit() -> None:
    """``serve --early-exit`` answers as the in-process engine with the same exits does, and
    not as it does without them (a threshold of 0: every token exits after block 1)."""
    from mdiedge.engine.opening import exit_settings_of
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.engine.engine import TextModel
    from mdiedge.engine.local import LocalEngine

    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen([*MDIEDGE, "serve", "--port", "0", "--nodes",
                             "1", "--slots", "1", "--early-exit", "softmax",
                             "--exit-threshold", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        client = openai.OpenAI(base_url=ready["url"], api_key="unused", max_retries=0,
                               timeout=60)
        served = client.completions.create(model=ready["model"], prompt="ROMEO:", max_tokens=10,
                                           temperature=0).choices[0].text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    # --slots given, the context sized: NanoLlama's own 1024 fits any machine that runs this
    assert re.search(r"^mdiedge: serve: 1 slot x 1024 tokens, KV cache 6.00 MiB for the 12 "
                     r"blocks on this machine, (<1|\d+)% of [\d.]+ [GM]iB available: within 25% of "
                     r"it$", err, re.M), err
    greedy = SamplingParams(temperature=0)
    exits = exit_settings_of(TextModel(None, None), "softmax", "0")
    texts = [LocalEngine(early_exit=e).generate("ROMEO:", 10, params=greedy).samples[0]["text"]
             for e in (exits, None)]
    assert served == texts[0] != texts[1]
