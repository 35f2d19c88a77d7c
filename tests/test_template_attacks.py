"""A model file's chat template is code from a stranger (issue 45, findings 1 and 2). GGUF
files whose ``tokenizer.chat_template`` loops for ever, makes a text of 20 MB, asks for a range
of 10**12, recurses without end or runs past the render's deadline: a real ``mdiedge serve``
answers the chat request with one 400 naming the template while ``/health`` and other requests
keep answering within a second, and no thread is left spinning; ``mdiedge chat --message``
prints one line and exits 1. A template that cannot be compiled (nested too deeply) is one line
at load."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx
import pytest

from commands import MDIEDGE
from conftest import make_hf_llama, write_tiny_tokenizer

pytest.importorskip("gguf")

HOSTILE = {  # name: (template, what the error says)
    "loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
              "{% endfor %}", "limit of 200000 steps"),
    "repeat": ("{{ 'x' * 20000000 }}", "a repeated value of 20000000"),
    "range": ("{{ range(10**12) | list }}", "OverflowError: Range too big"),
    "recursion": ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
                  "nests macros or recursive loops deeper than its limit"),
    "slow": ("{% for i in range(90000) %}{% set top = range(4000) | max %}{% endfor %}",
             "did not finish within 2 s"),
}
UNCOMPILABLE = "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"
CHAT = {"messages": [{"role": "user", "content": "hello ring"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: Any) -> Path:
    path = make_hf_llama(tmp_path_factory.mktemp("tmpl-llama"), seed=5, num_hidden_layers=2,
                         max_position_embeddings=256)
    write_tiny_tokenizer(path)
    return path


def templated_gguf(hf: Path, folder: Path, template: str) -> Path:
    """A tiny GGUF file whose ``tokenizer.chat_template`` is ``template`` (the converter takes
    it from tokenizer_config.json beside tokenizer.model)."""
    from gguf_files import write_gguf

    vocab = folder / "vocab"
    vocab.mkdir()
    shutil.copy(hf / "tokenizer.model", vocab)
    (vocab / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return write_gguf(folder / "templated.gguf", hf, "F32", tokenizer=vocab)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def serve_file(request: Any) -> Iterator[Any]:
    procs: List[subprocess.Popen] = []

    def start(model: Path) -> Any:
        env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
        proc = subprocess.Popen([*MDIEDGE, "serve", "--port", "0", "--nodes", "1", "--model",
                                 str(model), "--slots", "2", "--context", "128"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        procs.append(proc)
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        return str(ready["url"]).rsplit("/v1", 1)[0], int(ready["pid"])
    yield start
    for proc in procs:
        proc.terminate()
        proc.communicate(timeout=60)


def timed_get(url: str) -> float:
    began = time.monotonic()
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    return time.monotonic() - began


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_serve_answers_a_hostile_template_with_a_400_and_keeps_serving(
        name: str, tiny_hf: Path, tmp_path: Path, serve_file: Any) -> None:
    template, says = HOSTILE[name]
    url, pid = serve_file(templated_gguf(tiny_hf, tmp_path, template))
    timed_get(url + "/health")  # a first connection's set-up is not the template's
    answer: Dict[str, Any] = {}

    def bad() -> None:
        try:
            answer["response"] = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
        except httpx.HTTPError as e:
            answer["error"] = e
    client = threading.Thread(target=bad)
    client.start()
    waits = []
    while client.is_alive() or not waits:
        waits += [timed_get(url + "/health"), timed_get(url + "/v1/models")]
        client.join(0.1)
    assert max(waits) < 1.0, waits
    response: Optional[httpx.Response] = answer.get("response")
    assert response is not None, answer
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "template_error", response.text
    assert error["param"] == "messages" and says in error["message"], error
    before = cpu_seconds(pid)
    time.sleep(1.0)
    assert cpu_seconds(pid) - before < 0.3  # no render left spinning on a thread
    completion = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                            timeout=60)
    assert completion.status_code == 200, completion.text


@pytest.mark.parametrize("name", sorted(HOSTILE) + ["uncompilable"])
def test_chat_says_a_hostile_template_in_one_line(name: str, tiny_hf: Path,
                                                   tmp_path: Path) -> None:
    template, says = HOSTILE.get(name, (UNCOMPILABLE, "cannot be compiled: RecursionError"))
    model = templated_gguf(tiny_hf, tmp_path, template)
    done = subprocess.run([*MDIEDGE, "chat", "--model", str(model), "--message", "hi", "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stdout == "", done.stderr
    assert done.stderr.startswith("mdiedge: error: ") and says in done.stderr, done.stderr


def test_text_beyond_what_the_context_holds_is_refused_before_it_is_rendered() -> None:
    from mdiedge.base.errors import ApiError, ContextExceeded
    from mdiedge.serving.api.chat import ChatTemplate
    from mdiedge.serving.api.schema import ChatMessage

    template = ChatTemplate(context=128)
    with pytest.raises(ContextExceeded, match="5000 bytes, more than a 128-token context"):
        template.prompt([ChatMessage("user", "x" * 5000)])
    with pytest.raises(ApiError) as caught:
        template.render([ChatMessage("user", "x" * 5000)])
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    inflating = ChatTemplate("{% for i in range(100) %}{{ messages[0].content }}{% endfor %}",
                             context=128)
    with pytest.raises(ContextExceeded, match="the chat template rendered a prompt of 4400"):
        inflating.prompt([ChatMessage("user", "x" * 44)])


def test_chat_drops_old_turns_whose_text_is_beyond_the_context(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mdiedge.base.request import Asked
    from mdiedge.cli.chat import ChatSession, Conversation

    engine = SimpleNamespace(path=tmp_path, tokenizer=None, cfg=SimpleNamespace(max_seq_len=256),
                             prompt=lambda text, templated: SimpleNamespace(
                                 ids=list(range(len(text) // 4))))
    conversation = Conversation(turns=[("q" * 3000, "a" * 3000)] * 3)
    session = ChatSession(engine, conversation, Asked(8), interactive=False)  # type: ignore
    assert len(session.prompt("hi").ids) < 256 and conversation.turns == []
