"""stories260K as the tests that count a request's work run it: its command-line flags, and
an in-process API server of it with the official ``openai`` client."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, List

import openai


def stories_args(stories: Path) -> List[str]:
    return ["--model", str(stories / "stories260K.bin"), "--tokenizer",
            str(stories / "tok512.model")]


@contextlib.contextmanager
def stories_client(stories: Path) -> Iterator[openai.OpenAI]:
    """A client of an in-process server of stories260K (2 slots of 128 tokens), closed after."""
    from mdiedge.engine.local import LocalEngine
    from mdiedge.serving.api.rules import ServeLimits
    from mdiedge.serving.api.server import Api, listen

    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    server = Api(engine, listen("127.0.0.1", 0), ServeLimits(slots=2, context=128,
                                                             max_waiting=2),
                 name="stories").start()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                            timeout=60)
    finally:
        server.close()
