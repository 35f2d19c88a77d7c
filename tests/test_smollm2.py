"""Greedy output of SmolLM2-135M-Instruct equals transformers' (fp32, de-quantized from the
GGUF file) for 40 new tokens, from the converted directory (fp32) and from the GGUF file itself
(``--model smollm2``: its tokenizer and template, its Q4_1 blocks kept quantized), as a user
meets it: ``mdiedge generate`` on a plain prompt in
one process and across a ring of three, ``mdiedge chat --message`` with the model's chat
template (the answer alone on stdout), and ``mdiedge serve`` through the official ``openai``
client (the prompt's token count and the text)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest
from smollm2 import NEW_TOKENS, Reference
from commands import MDIEDGE

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a geography teacher. Answer in one short sentence."
KEY = "smollm2-test-key"
RUN_S = 300  # one command's limit: loading the model and 40 tokens take seconds


@pytest.fixture(scope="module")
def reference(smollm2_reference: Reference) -> Reference:
    return smollm2_reference


def mdiedge(*args: str) -> subprocess.CompletedProcess:
    """``mdiedge ARGS`` as a user runs it, with no standard input; stderr on failure."""
    out = subprocess.run([*MDIEDGE, *args], capture_output=True,
                         text=True, timeout=RUN_S, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"mdiedge {' '.join(args)}: exit {out.returncode}\n{out.stderr}"
    return out


def model_arg(kind: str, smollm2_dir: Path) -> str:
    """``--model`` for the converted directory ("dir") or the installed GGUF file ("gguf")."""
    return str(smollm2_dir) if kind == "dir" else "smollm2"


@pytest.mark.parametrize("kind", ["dir", "gguf"])
@pytest.mark.parametrize("nodes", [1, 3])
def test_generate_is_transformers_greedy(smollm2_dir: Path, reference: Reference,
                                         nodes: int, kind: str) -> None:
    prompt = reference.plain(PROMPT)
    out = json.loads(mdiedge("generate", PROMPT, "--model", model_arg(kind, smollm2_dir), "-n",
                             str(NEW_TOKENS), "--temperature", "0", "--nodes", str(nodes),
                             "--json").stdout)
    sample = out["samples"][0]
    assert out["prompt_tokens"] == len(prompt)
    assert sample["token_ids"] == reference.continue_ids(prompt)
    assert sample["finish_reason"] == ("eos" if reference.stopped(prompt) else "length")
    assert sample["text"] == reference.answer_text(prompt)
    if kind == "gguf":  # its Q4_1 blocks and head in the compiled step on every node
        assert [(n["blocks"], n.get("head", "step")) for n in out["decode"]] == \
            [("step", "step")] * nodes


@pytest.mark.parametrize("kind, system", [("dir", None), ("dir", SYSTEM), ("gguf", SYSTEM)],
                         ids=["template-system", "own-system", "gguf"])
def test_chat_message_is_transformers_greedy(smollm2_dir: Path, reference: Reference,
                                             system: Optional[str], kind: str) -> None:
    extra = ["--system", system] if system else []
    out = mdiedge("chat", "--message", QUESTION, *extra, "--model",
                  model_arg(kind, smollm2_dir), "-n",
                  str(NEW_TOKENS), "--temperature", "0", "--nodes", "1")
    assert out.stdout.rstrip("\n") == reference.answer_text(reference.chat(QUESTION, system))


@pytest.fixture(scope="module", params=["dir", "gguf"])
def served(smollm2_dir: Path, request: Any) -> Iterator[Dict[str, Any]]:
    """``mdiedge serve`` on the converted directory or the GGUF file (a ring of two); its
    ready line (the API's ``url``, the ``model`` name it serves)."""
    env = dict(os.environ, MDIEDGE_API_KEY=KEY)
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "2", "--slots", "1",
         "--context", "512", "--model", model_arg(request.param, smollm2_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(20)
            raise AssertionError(f"serve did not start: {proc.stderr.read()}")
        yield json.loads(line)
    finally:
        proc.terminate()
        proc.wait(30)


def client(served: Dict[str, Any]) -> Any:
    import openai

    return openai.OpenAI(base_url=served["url"], api_key=KEY, max_retries=0, timeout=RUN_S)


def test_serve_chat_is_transformers_greedy(served: Dict[str, Any], reference: Reference) -> None:
    reply = client(served).chat.completions.create(
        model=served["model"], max_tokens=NEW_TOKENS, temperature=0,
        messages=[{"role": "user", "content": QUESTION}])
    prompt = reference.chat(QUESTION)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == reference.answer_text(prompt)
    assert reply.choices[0].finish_reason == ("stop" if reference.stopped(prompt) else "length")


def test_serve_completion_is_transformers_greedy(served: Dict[str, Any],
                                                reference: Reference) -> None:
    reply = client(served).completions.create(model=served["model"], prompt=PROMPT,
                                              max_tokens=NEW_TOKENS, temperature=0)
    prompt = reference.plain(PROMPT)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].text == reference.answer_text(prompt)
