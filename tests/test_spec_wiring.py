"""Speculative decoding through the one scheduler (``--speculate``): greedy tokens exactly
plain decoding's on NanoLlama in one process, over 3 in-process stages and over a real ring
of 3 nodes, with 1 and 3 samples, drafting by prompt lookup and with the draft model; the
token budget and stop strings exactly respected; a seed gives the same sampled text on 1 and
3 nodes; the CLI's flag, its ``--json`` report and its refusal next to early exit."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from mdiedge.engine.engine import Engine
from mdiedge.engine.local import LocalEngine
from mdiedge.engine.ring import RingEngine
from mdiedge.model.sampling import SamplingParams
from mdiedge.roles.local_ring import LocalRing
from commands import MDIEDGE

REPO = Path(__file__).resolve().parent.parent
NANOLLAMA = REPO / "models" / "nanollama"
DRAFT = f"draft:{REPO / 'models' / 'nanollama-draft'}"
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=5)
PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "
           "Juliet is the sun.\n")
PROMPT = f"{PASSAGE}{PASSAGE}{PASSAGE}"  # repeats itself: prompt lookup has drafts to offer
DRAFTERS = ["ngram", DRAFT]


def run(engine: Engine, speculate: str, n: int = 40, samples: int = 1,
        params: SamplingParams = GREEDY, stop: Tuple[str, ...] = ()) -> Any:
    engine.speculating(speculate)
    try:
        return engine.generate(PROMPT, n, samples, params, stop=stop)
    finally:
        engine.speculating(None)


def tokens_of(out: Any) -> List[List[int]]:
    return [s["token_ids"] for s in out.samples]


@pytest.fixture(scope="module", params=[1, 3], ids=lambda n: f"{n}-stages")
def local(request: Any) -> LocalEngine:
    return LocalEngine(NANOLLAMA, stages=request.param)


@pytest.fixture(scope="module")
def ring() -> Iterator[RingEngine]:
    workers = LocalRing(2, threads=1)
    with workers as nodes:
        engine = RingEngine(nodes, NANOLLAMA, timeout_s=60, secret=workers.secret)
        yield engine
        engine.close()


@pytest.fixture(scope="module")
def plain() -> Dict[int, Any]:
    """Plain greedy decoding in one process, by number of samples."""
    engine = LocalEngine(NANOLLAMA)
    return {n: engine.generate(PROMPT, 40, n, GREEDY) for n in (1, 3)}


def check_speculated(out: Any, want: Any) -> None:
    assert tokens_of(out) == tokens_of(want)
    stats = out.as_dict()["speculation"]
    assert stats["drafted"] > 0 and stats["accepted"] > 0  # it did speculate, and gained
    assert stats["tokens_per_pass"] > 1.0


@pytest.mark.parametrize("samples", [1, 3])
@pytest.mark.parametrize("speculate", DRAFTERS, ids=["ngram", "draft"])
def test_greedy_in_process_equals_plain(local: LocalEngine, plain: Dict[int, Any],
                                        speculate: str, samples: int) -> None:
    check_speculated(run(local, speculate, samples=samples), plain[samples])


@pytest.mark.parametrize("samples", [1, 3])
@pytest.mark.parametrize("speculate", DRAFTERS, ids=["ngram", "draft"])
def test_greedy_on_a_ring_of_three_equals_plain(ring: RingEngine, plain: Dict[int, Any],
                                                speculate: str, samples: int) -> None:
    check_speculated(run(ring, speculate, samples=samples), plain[samples])


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_the_token_budget_is_never_overshot(local: LocalEngine, plain: Dict[int, Any],
                                            n: int) -> None:
    out = run(local, "ngram", n=n)
    assert tokens_of(out) == [tokens_of(plain[1])[0][:n]]
    assert out.samples[0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_sample_where_plain_decoding_does(local: LocalEngine,
                                                                 plain: Dict[int, Any]) -> None:
    text = plain[1].samples[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 4]  # met mid-way, inside an accepted run
    want = local.generate(PROMPT, 40, 1, GREEDY, stop=(stop,))
    got = run(local, "ngram", stop=(stop,))
    assert got.samples[0]["finish_reason"] == want.samples[0]["finish_reason"] == "stop"
    assert got.samples[0]["text"] == want.samples[0]["text"]
    assert stop not in got.samples[0]["text"]
    assert tokens_of(got) == tokens_of(want)


@pytest.mark.parametrize("speculate", DRAFTERS, ids=["ngram", "draft"])
def test_a_seed_gives_the_same_sampled_text_on_one_and_three_nodes(
        ring: RingEngine, speculate: str) -> None:
    one = run(LocalEngine(NANOLLAMA), speculate, samples=3, params=SAMPLED)
    three = run(ring, speculate, samples=3, params=SAMPLED)
    assert tokens_of(one) == tokens_of(three)
    assert one.as_dict()["speculation"]["drafted"] > 0


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MDIEDGE, "generate", PROMPT, "--model",
                           str(NANOLLAMA), "--temperature", "0", *args],
                          capture_output=True, text=True, timeout=300)


def test_the_cli_speculates_on_a_local_ring_and_reports_it(plain: Dict[int, Any]) -> None:
    done = cli("-n", "40", "--nodes", "3", "--json", "--speculate", "ngram")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["samples"][0]["token_ids"] == tokens_of(plain[1])[0]
    report = result["speculation"]
    assert report["accepted"] > 0 and sum(report["k_histogram"].values()) > 0
    off = json.loads(cli("-n", "3", "--nodes", "1", "--json").stdout)
    assert "speculation" not in off


@pytest.mark.parametrize("args, quoted", [
    (["--early-exit", "softmax", "--speculate", "ngram"], "--early-exit"),
    (["--speculate", "bigram"], "'bigram'"),
    (["--speculate", "draft:/no/such/draft"], "--speculate draft:/no/such/draft: "),
])
def test_the_cli_refuses_in_one_line(args: List[str], quoted: str) -> None:
    done = cli("-n", "3", "--nodes", "1", *args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mdiedge: error: ") and quoted in lines[0]


def test_an_engine_spec_refuses_speculation_with_early_exit() -> None:
    from mdiedge.base.errors import UsageError
    from mdiedge.engine.opening import EngineSpec, check_spec

    with pytest.raises(UsageError, match="--early-exit softmax"):
        check_spec(EngineSpec(model=NANOLLAMA, early_exit="softmax", speculate="ngram"))


def test_a_draft_model_of_another_vocabulary_is_refused_before_anything_runs(
        stories: Path) -> None:
    from mdiedge.base.errors import ConfigError
    from mdiedge.engine.opening import EngineSpec, open_engine

    draft = stories / "stories260K.bin"
    with pytest.raises(ConfigError, match="vocabulary 512"):
        open_engine(EngineSpec(model=NANOLLAMA, speculate=f"draft:{draft}"))
