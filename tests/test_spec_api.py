"""Speculative decoding in the OpenAI API, driven by the official ``openai`` client: the
extra body field ``speculate`` (``ngram``, ``draft``: the server's draft model, ``off``) over
the server's default (``serve --speculate``); greedy text the same with and without; a bad
value a 400 naming the field; the ``mdiedge_spec_*`` metrics; one draft model per engine,
shared by concurrent requests in slots of their own and left empty when they end (or when
the pipeline breaks under them)."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx
import openai
import pytest

from mdiedge.base.errors import ConfigError, RingError
from mdiedge.engine.local import LocalEngine
from mdiedge.model.checkpoint import load_config
from mdiedge.model.sampling import SamplingParams
from mdiedge.runtime.draftmodel import DraftModel
from mdiedge.runtime.drafting import request_speculate
from mdiedge.serving.api.rules import ServeLimits
from mdiedge.serving.api.server import Api, listen
from commands import MDIEDGE

REPO = Path(__file__).resolve().parent.parent
NANOLLAMA = REPO / "models" / "nanollama"
DRAFT = f"draft:{REPO / 'models' / 'nanollama-draft'}"
PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "
           "Juliet is the sun.\n")
PROMPT = f"{PASSAGE}{PASSAGE}{PASSAGE}"  # repeats itself: prompt lookup has drafts to offer
OTHER = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n" * 2
SLOTS = 4
SPEC = ("drafted_tokens_total", "accepted_tokens_total", "verify_steps_total",
        "tokens_per_pass_count")


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    engine = LocalEngine(NANOLLAMA)
    engine.speculating(DRAFT)  # the server's default: the draft model
    return engine


@pytest.fixture(scope="module")
def api(engine: LocalEngine) -> Iterator[Api]:
    server = Api(engine, listen("127.0.0.1", 0),
                 ServeLimits(slots=SLOTS, context=512, max_waiting=8), name="nanollama").start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(api: Api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, speculate: Optional[str], prompt: str = PROMPT,
             n: int = 40) -> str:
    extra = {} if speculate is None else {"speculate": speculate}
    response = client.completions.create(model="nanollama", prompt=prompt, max_tokens=n,
                                         temperature=0, extra_body=extra)
    return response.choices[0].text


def spec_metrics(url: str) -> Dict[str, float]:
    """The ``mdiedge_spec_*`` figures of ``/metrics`` (``url``: the server's, or its /v1)."""
    text = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("mdiedge_spec_") and name[len("mdiedge_spec_"):] in SPEC:
            out[name[len("mdiedge_spec_"):]] = float(value)
    return out


def moved(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    return {k: after[k] - before[k] for k in SPEC}


@pytest.fixture(scope="module")
def plain(client: openai.OpenAI) -> Dict[str, str]:
    """Each prompt's greedy text with speculation off."""
    return {p: complete(client, "off", p) for p in (PROMPT, OTHER)}


@pytest.mark.parametrize("speculate", ["ngram", "draft"])
def test_a_speculating_request_gives_the_plain_greedy_text(client: openai.OpenAI, api: Api,
                                                           plain: Dict[str, str],
                                                           speculate: str) -> None:
    before = spec_metrics(api.url)
    assert complete(client, speculate) == plain[PROMPT]
    delta = moved(before, spec_metrics(api.url))
    assert delta["accepted_tokens_total"] > 0 and delta["tokens_per_pass_count"] == 1
    assert delta["drafted_tokens_total"] >= delta["accepted_tokens_total"]
    assert 0 < delta["verify_steps_total"] < 40  # fewer passes than tokens


def test_the_server_default_applies_and_off_overrides_it(client: openai.OpenAI, api: Api,
                                                         plain: Dict[str, str]) -> None:
    before = spec_metrics(api.url)
    assert complete(client, None) == plain[PROMPT]  # the default: the draft model
    after = spec_metrics(api.url)
    assert moved(before, after)["drafted_tokens_total"] > 0
    assert complete(client, "off") == plain[PROMPT]
    assert moved(after, spec_metrics(api.url)) == {k: 0.0 for k in SPEC}


@pytest.mark.parametrize("value, status, message", [
    ("fast", openai.BadRequestError, "speculate: expected one of ngram, draft, off, got 'fast'"),
    ("draft:/tmp/model", openai.BadRequestError, "speculate: expected one of"),
    (3, openai.BadRequestError, "speculate: expected a string, got 3"),
])
def test_a_bad_speculate_value_is_refused_naming_the_field(client: openai.OpenAI, value: Any,
                                                          status: type, message: str) -> None:
    with pytest.raises(status, match=message) as caught:
        client.completions.create(model="nanollama", prompt="ROMEO:", max_tokens=4,
                                  extra_body={"speculate": value})
    assert caught.value.body["param"] == "speculate"  # type: ignore[index]
    with pytest.raises(status, match=message):
        client.chat.completions.create(model="nanollama", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"speculate": value})


def test_concurrent_requests_share_the_draft_model_in_slots_of_their_own(
        client: openai.OpenAI, api: Api, engine: LocalEngine) -> None:
    """Alone and together (both holding slots of the draft model at once), each request
    gives the same text: greedy, its plain text; sampled with a seed (whose drafts decide
    which tokens are drawn, and whose k never depends on timings), the same text and as
    many drafted and accepted tokens: a request that read another's KV rows would draft
    other tokens."""
    draft = engine.draft_model
    assert isinstance(draft, DraftModel) and draft.n_slots == SLOTS  # the server's slots
    n = 120
    plain = {p: complete(client, "off", p, n) for p in (PROMPT, OTHER)}
    alone = {}
    for prompt in (PROMPT, OTHER):
        before = spec_metrics(api.url)
        alone[prompt] = (sampled(client, prompt, n), moved(before, spec_metrics(api.url)))
        assert complete(client, "draft", prompt, n) == plain[prompt]
    for ask in (sampled, lambda c, p, n: complete(c, "draft", p, n)):
        before = spec_metrics(api.url)
        texts, held = both(client, draft, ask, n)
        assert held == 2  # the two ran at once
        if ask is sampled:
            assert texts == {p: alone[p][0] for p in (PROMPT, OTHER)}
            together = moved(before, spec_metrics(api.url))
            for key in ("drafted_tokens_total", "accepted_tokens_total"):
                assert together[key] == alone[PROMPT][1][key] + alone[OTHER][1][key] > 0
        else:
            assert texts == plain
    assert engine.draft_model is draft  # loaded once
    assert draft.slots.in_use == 0


def sampled(client: openai.OpenAI, prompt: str, n: int) -> str:
    response = client.completions.create(model="nanollama", prompt=prompt, max_tokens=n,
                                         temperature=0.8, seed=7,
                                         extra_body={"speculate": "draft", "top_k": 40})
    return response.choices[0].text


def both(client: openai.OpenAI, draft: DraftModel, ask: Any, n: int) -> Any:
    """Each prompt's text from ``ask`` with the two sent at once, and the most slots of the
    draft model held meanwhile."""
    texts: Dict[str, str] = {}
    start = threading.Barrier(2)

    def one(prompt: str) -> None:
        start.wait()
        texts[prompt] = ask(client, prompt, n)

    threads = [threading.Thread(target=one, args=(p,)) for p in (PROMPT, OTHER)]
    for t in threads:
        t.start()
    held = 0
    while any(t.is_alive() for t in threads):
        held = max(held, draft.slots.in_use)
        time.sleep(0.002)
    return texts, held


def test_a_dropped_stream_leaves_no_draft_slot_behind(api: Api, engine: LocalEngine) -> None:
    body = {"model": "nanollama", "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "stream": True, "speculate": "draft"}
    draft = engine.draft_model
    assert draft is not None
    held = 0
    with httpx.stream("POST", api.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():  # until its sample holds a draft slot
            held = draft.slots.in_use
            if held:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and draft.slots.in_use:
        time.sleep(0.1)
    assert held == 1 and draft.slots.in_use == 0


# ------------------------------------------------------------------ mdiedge serve --speculate

def serve(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    return subprocess.Popen([*MDIEDGE, "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_serve_speculate_sets_the_default_a_request_overrides() -> None:
    proc = serve("--nodes", "1", "--slots", "2", "--context", "512", "--speculate", "ngram")
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        url = ready["url"]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        texts: List[str] = []
        deltas = []
        for speculate in (None, "off"):
            before = spec_metrics(url)
            texts.append(complete(client, speculate))
            deltas.append(moved(before, spec_metrics(url)))
        assert texts[0] == texts[1]
        assert deltas[0]["accepted_tokens_total"] > 0  # the default: prompt lookup
        assert deltas[1] == {k: 0.0 for k in SPEC}  # the request's "off"
        with pytest.raises(openai.BadRequestError, match="speculate 'draft': this server has "
                           "no draft model"):
            complete(client, "draft")
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("args, message", [
    (["--speculate", "ngram", "--early-exit", "softmax"],
     "--speculate: expected off with --early-exit softmax"),
    (["--speculate", "fast"], "speculate 'fast': expected ngram, ngram:N (1..16) or draft:PATH"),
])
def test_bad_serve_speculate_options_are_one_line_errors(args: List[str], message: str) -> None:
    proc = serve("--nodes", "1", *args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


# ------------------------------------------------------------------ the shared draft model

@pytest.mark.parametrize("default, requested, want", [
    (None, None, None), ("off", None, None), ("ngram", None, "ngram"), (DRAFT, None, DRAFT),
    (DRAFT, "off", None), ("ngram:5", "off", None), (None, "off", None),
    (None, "ngram", "ngram"), (DRAFT, "ngram", "ngram"), ("ngram:5", "ngram", "ngram:5"),
    (DRAFT, "draft", DRAFT),
])
def test_a_requests_choice_over_the_default(default: Optional[str], requested: Optional[str],
                                            want: Optional[str]) -> None:
    assert request_speculate(default, requested) == want


@pytest.mark.parametrize("default, requested, message", [
    (None, "draft", "speculate 'draft': this server has no draft model"),
    ("ngram", "draft", "speculate 'draft': this server has no draft model"),
    (DRAFT, "fast", "speculate 'fast': expected one of ngram, draft, off"),
])
def test_a_choice_the_engine_cannot_serve_is_quoted(default: Optional[str], requested: str,
                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        request_speculate(default, requested)


def test_the_draft_models_slots_grow_only_when_none_is_held() -> None:
    draft = DraftModel.load(DRAFT.split(":", 1)[1], load_config(NANOLLAMA))
    assert (draft.n_slots, draft.context) == (0, 0) and not draft.holds(1, 16)
    draft.fit(2, 64)
    assert (draft.n_slots, draft.context) == (2, 64)
    assert draft.holds(2, 64) and not draft.holds(3, 64) and not draft.holds(2, 65)
    drafter = draft.drafter(SamplingParams(temperature=0))
    assert len(drafter.propose(0, [1, 827, 2007], 3).tokens) == 3
    draft.fit(4, 128)  # a slot is held: as it was
    assert (draft.n_slots, draft.context) == (2, 64)
    assert drafter.propose(1, [1, 827], 2).tokens and draft.slots.in_use == 2
    assert draft.drafter(SamplingParams(temperature=0)).propose(0, [1, 827], 2).tokens == []
    drafter.close()  # every slot held: a third sample is drafted nothing, then all go
    assert draft.slots.in_use == 0 and drafter.samples == 0
    draft.fit(4, 128)
    assert (draft.n_slots, draft.context) == (4, 128)


def test_a_broken_pipeline_leaves_no_draft_slot_behind() -> None:
    engine = LocalEngine(NANOLLAMA, stages=2)
    engine.speculating(DRAFT)
    scheduler = engine.prepare(4, 256)
    pipeline = scheduler.pipeline
    pipeline.stages[1] = _Failing(pipeline.stages[1], fail_at=6)
    a = engine.new_generation(PROMPT, 40, 1, SamplingParams(temperature=0))
    b = engine.new_generation(PROMPT, 40, 2, SamplingParams(temperature=0))
    draft = engine.draft_model
    assert draft is not None and draft.n_slots == 2
    scheduler.submit(a)
    with pytest.raises(RingError, match="lost its node"):
        scheduler.run(b)
    assert a.error is b.error and isinstance(a.error, RingError)
    assert a.speculation is not None and a.speculation.stats.drafted > 0
    assert draft.slots.in_use == 0


class _Failing:
    """A stage that fails on its ``fail_at``-th message."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner, self.fail_at, self.seen = inner, fail_at, 0
        self.n_slots, self.context = inner.n_slots, inner.context

    def forward(self, message: Any) -> Any:
        self.seen += 1
        if self.seen == self.fail_at:
            raise RingError("stage 1 lost its node")
        return self.inner.forward(message)
