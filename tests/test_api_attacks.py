"""The API against what a careless or hostile client sends: values no float or text holds,
deep nesting, silent and slow connections, bursts that fit the slots, a shutdown mid-request.
Each answer is an OpenAI-shaped 4xx/5xx naming the field, and the server keeps serving."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

from mdiedge.serving.api import bodies as api_bodies
from mdiedge.serving.api import server as api_server
from mdiedge.serving.api.rules import ServeLimits
from mdiedge.serving.api.server import Api, listen
from mdiedge.engine.local import LocalEngine
from mdiedge.runtime.generation import Generation

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def api(stories: Path) -> Iterator[Api]:
    """Eight slots and no queue: a request is taken only when it fits at once."""
    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    server = Api(engine, listen("127.0.0.1", 0),
                 ServeLimits(slots=8, context=128, max_waiting=0), name="stories").start()
    yield server
    server.close()


def post(api: Api, body: Any, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else None
    return httpx.post(api.url + path, content=content, timeout=30,
                      json=None if content is not None else body)


def error_of(response: httpx.Response) -> Dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return response.json()["error"]


@pytest.mark.parametrize("raw, status, param, match", [
    ('{"prompt": "a\\ud800b", "max_tokens": 3}', 400, None, r"lone UTF-16 surrogate \('\\ud800'\)"),
    ('{"prompt": "a", "\\udfff": 1}', 400, None, "lone UTF-16 surrogate"),
    ('{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, None, "surrogate"),
    ("[" * 100_000 + "]" * 100_000, 400, None, "nested too deeply"),
    ('{"prompt": "a", "x": ' + "[" * 50_000 + "]" * 50_000 + "}", 400, None, "nested too deeply"),
    ('{"prompt": "a", "temperature": 1' + "0" * 400 + "}", 400, "temperature", r"\[0, 2\]"),
    ('{"prompt": "a", "top_p": 1' + "0" * 400 + "}", 400, "top_p", r"\(0, 1\]"),
    ('{"prompt": "a", "stop": [""]}', 400, "stop", "non-empty"),
    ('{"prompt": "a", "stop": ' + str(["x"] * 17).replace("'", '"') + "}", 400, "stop",
     "at most 16"),
    ('{"prompt": "' + "the " * 400 + '"}', 400, "prompt", "leaves no room"),
])
def test_bodies_the_server_cannot_take_are_400s(api: Api, raw: str, status: int, param: Any,
                                                 match: str) -> None:
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    response = post(api, raw.encode(), path)
    assert response.status_code == status
    error = error_of(response)
    assert error["param"] == param
    assert re.search(match, error["message"]), error["message"]
    assert post(api, {"prompt": "Once", "max_tokens": 2}).status_code == 200  # still serving


def test_chat_errors_name_the_fields_the_client_sent(api: Api) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    zero = post(api, dict(chat, max_completion_tokens=0), "/v1/chat/completions")
    assert zero.status_code == 400 and error_of(zero)["param"] == "max_completion_tokens"
    assert "max_completion_tokens: expected an integer >= 1, got 0" in error_of(zero)["message"]
    named = post(api, {"messages": [{"role": "user", "content": "Hi", "name": 5}]},
                 "/v1/chat/completions")
    assert named.status_code == 400 and "messages[0].name" in error_of(named)["message"]
    usage = post(api, dict(chat, max_tokens=2, stream_options={"include_usage": None}),
                 "/v1/chat/completions")
    assert usage.status_code == 200


def test_a_temperature_near_zero_samples_as_greedy(api: Api) -> None:
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=60)
    texts = [client.completions.create(model="stories", prompt="Once", max_tokens=12, seed=1,
                                       temperature=t).choices[0].text
             for t in (0, 1e-300, 1e-45)]
    assert texts[1] == texts[0] and texts[2] == texts[0]


def test_requests_that_fit_the_free_slots_are_taken_at_once(api: Api) -> None:
    """No queue (max_waiting 0): requests not yet admitted but fitting are not 'waiting'."""
    codes: List[int] = []

    def one() -> None:
        codes.append(post(api, {"prompt": "Once", "max_tokens": 40}).status_code)

    for _ in range(3):
        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert codes == [200] * 12


def read_all(sock: socket.socket, within: float) -> bytes:
    """What the server sends on ``sock`` until it closes it (a timeout if not ``within``)."""
    sock.settimeout(within)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def wait_closed(sock: socket.socket, within: float) -> float:
    """Seconds until the server closes ``sock``."""
    started = time.monotonic()
    read_all(sock, within)
    return time.monotonic() - started


def test_silent_and_slow_clients_are_cut_off(api: Api, monkeypatch: Any) -> None:
    monkeypatch.setattr(api_server, "API_HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(api_bodies, "API_BODY_TIMEOUT_S", 0.5)
    host, port = api.server.host, api.server.port
    silent = socket.create_connection((host, port))
    slow = socket.create_connection((host, port))
    slow.sendall(b"GET /health HTTP/1.1\r\n")  # and never the rest of the headers
    assert wait_closed(silent, 10) < 5 and wait_closed(slow, 10) < 5
    body = socket.create_connection((host, port))
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    answer = read_all(body, 10).decode()
    assert answer.startswith("HTTP/1.1 408") and '"code":"timeout"' in answer
    for sock in (silent, slow, body):
        sock.close()
    # a request whose answer takes longer than the head's deadline is not cut
    stream = httpx.post(api.url + "/v1/completions", timeout=30,
                        json={"prompt": "Once", "max_tokens": 120, "stream": True})
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")


@pytest.fixture
def slow_tokens(monkeypatch: Any) -> None:
    """Every accepted token takes 5 ms more: a request lasts long enough to be cut short."""
    accept = Generation.accept

    def slowly(self: Generation, *args: Any) -> Any:
        time.sleep(0.005)
        return accept(self, *args)

    monkeypatch.setattr(Generation, "accept", slowly)


def test_a_shutdown_ends_requests_with_an_error_not_an_answer(stories: Path,
                                                              slow_tokens: None) -> None:
    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    server = Api(engine, listen("127.0.0.1", 0), ServeLimits(slots=2, context=256)).start()
    body = {"prompt": "Once", "max_tokens": 250, **GREEDY}
    whole: List[httpx.Response] = []
    waiter = threading.Thread(target=lambda: whole.append(
        httpx.post(server.url + "/v1/completions", json=body, timeout=30)))
    events: List[str] = []
    try:
        waiter.start()
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True),
                          timeout=30) as response:
            lines = response.iter_lines()
            events.append(next(lines))
            deadline = time.monotonic() + 10
            while server.service.counts()[0] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.service.counts()[0] == 2  # both run when the server shuts down
            threading.Thread(target=server.close).start()
            events += [line for line in lines if line]
        waiter.join(30)
    finally:
        server.close()
    assert json.loads(events[-1][len("data: "):])["error"]["code"] == "shutting_down"
    assert not any("cancelled" in e for e in events)
    assert whole[0].status_code == 503 and error_of(whole[0])["code"] == "shutting_down"
