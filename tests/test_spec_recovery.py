"""Recovery while speculating: a node lost in the middle of a greedy generation whose steps
verify prompt-lookup drafts (a prompt that repeats, so drafts are accepted). The replay
refills the KV rows of the accepted tokens only, and the output equals plain decoding's
without the loss, token for token: in one process (a pipeline that fails on cue, at several
points) and on a real ring of three whose worker is killed (SIGKILL) mid-generation."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.base.errors import NodeLost
from mdiedge.engine.local import LocalEngine
from mdiedge.model.sampling import SamplingParams
from mdiedge.roles.local_ring import LocalRing
from mdiedge.runtime.pipeline import EmbedAndHead
from mdiedge.runtime.scheduler import Scheduler
from test_recovery import FailingPipeline, kill, ring_engine, stages_of

REPO = Path(__file__).resolve().parent.parent
NANOLLAMA = REPO / "models" / "nanollama"
GREEDY = SamplingParams(temperature=0)
PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "
           "Juliet is the sun.\n")
PROMPT = f"{PASSAGE}{PASSAGE}{PASSAGE}"  # repeats itself: prompt lookup has drafts to offer
N = 40


@pytest.fixture(scope="module")
def reference() -> LocalEngine:
    return LocalEngine(NANOLLAMA)


@pytest.fixture(scope="module")
def plain(reference: LocalEngine) -> Dict[int, List[List[int]]]:
    """Plain greedy tokens, without speculation and without a loss, by number of samples."""
    return {n: [s["token_ids"] for s in reference.generate(PROMPT, N, n, GREEDY).samples]
            for n in (1, 3)}


@pytest.fixture(scope="module")
def split() -> LocalEngine:
    return LocalEngine(NANOLLAMA, stages=3)


@pytest.mark.parametrize("samples, micro_batch", [(1, 0), (3, 0), (3, 1)])
@pytest.mark.parametrize("fail_at", [3, 6, 11])
def test_a_loss_while_speculating_in_one_process(split: LocalEngine,
                                                 plain: Dict[int, List[List[int]]],
                                                 samples: int, micro_batch: int,
                                                 fail_at: int) -> None:
    rebuilds: List[NodeLost] = []

    def rebuild(lost: NodeLost) -> Any:
        rebuilds.append(lost)
        return FailingPipeline(stages_of(split, 4, 512), []), EmbedAndHead(split.model)

    split.speculating("ngram")
    try:
        generation = split.new_generation(PROMPT, N, samples, GREEDY)
        generation.speculation = split.speculation_for(generation)
    finally:
        split.speculating(None)
    scheduler = Scheduler(FailingPipeline(stages_of(split, 4, 512), [fail_at]),
                          EmbedAndHead(split.model), rebuild=rebuild)
    scheduler.run(generation, micro_batch)
    assert [s.tokens for s in generation.samples] == plain[samples]
    (record,) = generation.recoveries
    assert len(rebuilds) == 1 and record.pending == 0
    stats = generation.speculation.stats
    assert stats.accepted > 0 and stats.tokens_per_step > 1.0  # it speculated, and gained
    # the replay holds the prompt and the accepted tokens, never a rejected draft
    prompt = len(generation.samples[0].prompt)
    assert record.tokens_replayed <= samples * (prompt + N)


@pytest.mark.parametrize("samples, at, victim", [(1, 14, "w1"), (3, 50, "w2")])
def test_a_worker_killed_while_speculating_on_a_ring_of_three(
        plain: Dict[int, List[List[int]]], samples: int, at: int, victim: str) -> None:
    local = LocalRing(2)
    with local as workers:
        engine = ring_engine(local, workers, NANOLLAMA)
        engine.speculating("ngram")
        count = [0]
        hit = kill(local, victim)

        def on_token(index: int, token: int) -> None:
            count[0] += 1
            if count[0] == at:
                hit()

        try:
            out = engine.generate(PROMPT, N, samples, GREEDY, 0, on_token)
            assert [w.name for w in engine.starter.ring_workers] == \
                [w.name for w in workers if w.name != victim]
        finally:
            engine.close()
    assert [s["token_ids"] for s in out.samples] == plain[samples]
    (record,) = out.recoveries
    assert record.nodes == [victim] and record.tokens_replayed > 0
    report = out.as_dict()["speculation"]
    assert report["accepted"] > 0 and report["tokens_per_pass"] > 1.0
