"""The prompt cache: a finished request's KV rows kept on every node for a prompt that begins
with its tokens. The decisions as tables; the scheduler on one node and on a local ring
(the reused rows give the same text as computing them again); ``serve`` reporting
``cached_tokens`` and counting hits, and ``--no-prompt-cache``."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import openai
import pytest

from mdiedge.engine.engine import Engine
from mdiedge.engine.local import LocalEngine
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.generation import Generation
from mdiedge.runtime.promptcache import PromptCache, Reuse, best_reuse, runs_within, shared_prefix
from commands import MDIEDGE

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the park with her friends. One day, ")


@pytest.mark.parametrize("a, b, shared", [
    ([], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2], [1, 2, 3], 2),
    ([1, 2, 3], [2, 2, 3], 0), ([5, 6, 7, 8], [5, 6, 9, 8], 2),
])
def test_shared_prefix(a: List[int], b: List[int], shared: int) -> None:
    assert shared_prefix(a, b) == shared


PARKED = [(7, list(range(10))), (9, list(range(6))), (11, [0, 1, 2, 3, 99])]


@pytest.mark.parametrize("prompt, min_tokens, expected", [
    (list(range(20)), 1, Reuse(7, 10)),  # the longest shared prefix wins
    (list(range(10)), 1, Reuse(7, 9)),  # the prompt's last token is always computed
    (list(range(5)), 1, Reuse(7, 4)),  # ties: the first parked
    ([0, 1, 2, 3, 99, 5], 1, Reuse(11, 5)),
    (list(range(20)), 11, None),  # fewer than min_tokens shared
    ([1, 2, 3], 1, None),  # nothing shared
    ([0], 1, None),  # a one-token prompt reuses nothing
])
def test_best_reuse(prompt: List[int], min_tokens: int, expected: Any) -> None:
    assert best_reuse(prompt, PARKED, min_tokens) == expected


def test_the_cache_gives_back_the_oldest_past_its_capacity_and_adopts_once() -> None:
    cache = PromptCache(2, 2)
    assert cache.park(1, [1, 2, 3]) == [] and cache.park(2, [4, 5, 6]) == []
    assert cache.park(3, [7, 8, 9]) == [1] and list(cache.clear()) == [2, 3]
    cache.park(4, [1, 2, 3, 4])
    assert cache.adopt([1, 2, 3, 4, 5], exclude={4}) is None
    assert cache.adopt([1, 2, 3, 4, 5]) == Reuse(4, 4) and 4 not in cache
    assert cache.adopt([1, 2, 3, 4, 5]) is None  # adopted rows are the new sample's
    assert (cache.hits, cache.cached_tokens) == (1, 4)
    assert PromptCache(0, 1).enabled is False


@pytest.mark.parametrize("runs, tokens, within", [
    ([], 10, ()),
    ([(0, 128), (128, 200)], 300, ((0, 128), (128, 200))),
    ([(0, 128), (128, 200)], 150, ((0, 128), (128, 150))),  # cut: its rows before the cut
    ([(0, 128), (128, 200)], 128, ((0, 128),)),
])
def test_the_prefill_runs_of_the_rows_a_sample_takes_over(runs: List[Tuple[int, int]],
                                                          tokens: int, within: Any) -> None:
    assert runs_within(runs, tokens) == within


def test_an_adopted_sample_keeps_the_prefill_runs_of_its_rows() -> None:
    """So that a recovery replays them as they were computed (plan.replay)."""
    cache = PromptCache(2, 2)
    cache.park(4, list(range(40)), ((0, 16), (16, 32)))
    cache.park(5, [9, 9, 9], ((0, 3),))
    assert cache.adopt(list(range(20)) + [99]) == Reuse(4, 20, ((0, 16), (16, 20)))
    cache.clear()
    assert cache.adopt([9, 9, 9, 1]) is None


def run(engine: Engine, text: str, n: int = 12, cache: bool = True) -> Tuple[Generation, str]:
    generation = engine.new_generation(text, n, 1, SamplingParams(temperature=0))
    generation.cache_prompt = cache
    engine.run(generation)
    return generation, generation.samples[0].text


@pytest.fixture(params=[1, 3], ids=["one-node", "ring-of-3"], scope="module")
def cached_engine(request: Any, stories: Path) -> Iterator[Engine]:
    from mdiedge.engine.opening import EngineSpec, open_engine

    spec = EngineSpec(model=stories / "stories260K.bin", tokenizer=stories / "tok512.model",
                      nodes=request.param)
    with open_engine(spec) as engine:
        engine.prompt_cache = True
        engine.reserve(2, 256)
        yield engine


def test_the_next_turn_reuses_the_rows_and_gives_the_same_text(cached_engine: Engine) -> None:
    first, answer = run(cached_engine, STORY)
    assert first.cached_tokens == 0
    turn = STORY + answer + " Then"
    second, continued = run(cached_engine, turn)
    kept = len(first.samples[0].prompt) + len(first.samples[0].tokens) - 1
    assert kept - 2 <= second.cached_tokens <= kept, (kept, second.cached_tokens)
    again, recomputed = run(cached_engine, turn, cache=False)
    assert again.cached_tokens == 0 and continued == recomputed


def test_parked_rows_give_way_to_new_requests(cached_engine: Engine) -> None:
    scheduler = cached_engine.prepare(2, 256)
    outputs = {}
    for i in range(4):  # more different prompts than the 2 slots: the oldest rows go
        outputs[i] = run(cached_engine, f"{i} {i} " * 12 + STORY)[1]
        assert len(scheduler.cache) <= 2
    for i in (2, 3):  # the last two are still parked: a repeat reuses them, same text
        generation, text = run(cached_engine, f"{i} {i} " * 12 + STORY)
        assert generation.cached_tokens > 16 and text == outputs[i]
    nodes = cached_engine.status()
    assert all(n.slots_in_use <= 2 for n in nodes)


def test_a_cancelled_sample_is_not_parked(stories: Path) -> None:
    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    engine.prompt_cache = True
    engine.reserve(1, 256)
    with engine:
        generation = engine.new_generation(STORY, 40, 1, SamplingParams(temperature=0),
                                           on_token=lambda i, t: generation.cancel())
        engine.run(generation)
        assert generation.samples[0].finish_reason == "cancelled"
        assert len(engine.prepare(1, 256).cache) == 0


@pytest.fixture(scope="module")
def serve_pair(stories: Path) -> Iterator[Dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    procs, urls = [], {}
    for name, extra in (("on", []), ("off", ["--no-prompt-cache"])):
        proc = subprocess.Popen(
            [*MDIEDGE, "serve", "--port", "0", "--slots", "2", "--context", "256",
             "--model", str(stories / "stories260K.bin"),
             "--tokenizer", str(stories / "tok512.model"), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        procs.append(proc)
        assert proc.stdout is not None
        urls[name] = json.loads(proc.stdout.readline())["url"]
    yield urls
    for proc in procs:
        proc.terminate()
        proc.wait(20)


def cache_hits(url: str) -> float:
    text = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=10).text
    return float(re.search(r"^mdiedge_prompt_cache_hits_total (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("mode", ["on", "off"])
def test_serve_reports_cached_tokens(serve_pair: Dict[str, str], mode: str) -> None:
    client = openai.OpenAI(base_url=serve_pair[mode], api_key="unused", max_retries=0,
                           timeout=60)
    first = client.completions.create(model="stories260K", prompt=STORY, max_tokens=8,
                                      temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="stories260K", prompt=STORY + first.choices[0].text,
                                       max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    if mode == "on":
        assert cached >= first.usage.prompt_tokens and cache_hits(serve_pair[mode]) == 1
    else:
        assert cached == 0 and cache_hits(serve_pair[mode]) == 0
