"""A burst against a real ``serve`` (issue: 727 -> 1,187 MB and 6 -> 51 threads that stayed):
prompts far past the context are refused before they are tokenized, the handlers' threads
are bounded, and the memory the burst freed is given back once the server is idle."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from mdiedge.base import defaults
from commands import MDIEDGE


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


async def burst(url: str, requests: int, concurrency: int) -> int:
    refused = 0
    async with httpx.AsyncClient(timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            nonlocal refused
            async with gate:
                body = {"prompt": "x" * 300_000, "max_tokens": 2} if i % 2 else \
                    {"prompt": "Once upon a time", "max_tokens": 4}
                response = await client.post(url + "/completions", json=body)
                refused += response.status_code == 400
        await asyncio.gather(*(one(i) for i in range(requests)))
    return refused


def test_a_burst_leaves_memory_and_threads_bounded(stories: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen([*MDIEDGE, "serve", "--port", "0", "--nodes", "1", "--slots", "2",
                             "--context", "256", "--model", str(stories / "stories260K.bin"),
                             "--tokenizer", str(stories / "tok512.model")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        httpx.post(url + "/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
        before = rss_mb(proc.pid)
        started = time.monotonic()
        refused = asyncio.run(burst(url, 400, 64))
        assert refused == 200
        assert time.monotonic() - started < 60  # refused before tokenizing: fast
        most_threads = 4 + 2 + defaults.API_MAX_WAITING + defaults.API_THREADS + \
            defaults.TEMPLATE_THREADS + 8
        deadline = time.monotonic() + defaults.API_TRIM_S + 3  # a trim has run by then
        while True:  # looked at until both are within bounds, the trim's time at most
            grown = rss_mb(proc.pid) - before
            threads = len(os.listdir(f"/proc/{proc.pid}/task"))
            if (grown < 80 and threads <= most_threads) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert grown < 80, f"{grown:.0f} MB more resident after the burst"
        assert threads <= most_threads
    finally:
        proc.terminate()
        proc.wait(30)
