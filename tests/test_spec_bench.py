"""``mdiedge bench --speculate``: the workloads it builds, how a row is made of the runs (by
table), the alternating order, and a real run on NanoLlama in one process and on a ring of
two: every row's fields, the texts equal both ways, drafts accepted where the prompt repeats;
a drafter it cannot read refused in one line."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.base.errors import UsageError
from mdiedge.tools import speculationbench as specbench
from commands import MDIEDGE

REPO = Path(__file__).resolve().parent.parent
NANOLLAMA = REPO / "models" / "nanollama"
TEXT = "ONE:\nfirst line\nsecond line\n\nTWO:\nthird\n\nTHREE:\nfourth\nfifth\n\nFOUR:\nsixth\n"


def words(text: str) -> int:
    return len(text.split())


def test_paragraphs_and_passage() -> None:
    parts = specbench.paragraphs(TEXT)
    assert parts == ["ONE:\nfirst line\nsecond line\n", "TWO:\nthird\n", "THREE:\nfourth\nfifth\n",
                     "FOUR:\nsixth\n"]
    assert specbench.passage(parts, words, 5) == parts[:1]
    assert specbench.passage(parts, words, 6) == parts[:2]
    assert specbench.passage(parts, words, 100) == parts


def test_a_base_models_workloads_quote_the_passage_and_begin_it_again() -> None:
    repeat, free = specbench.workloads(TEXT, words, 6)
    assert repeat == specbench.Workload("repeat", "ONE:\nfirst line\nsecond line\n\nTWO:\n"
                                        "third\n\nONE:\n")
    assert free.name == "free" and not free.templated
    assert free.prompt.startswith("THREE:") or free.prompt.startswith("FOUR:")
    assert "first line" not in free.prompt


def test_an_instruct_models_workloads_go_through_its_template() -> None:
    repeat, free = specbench.workloads(TEXT, words, 5, render=lambda user: f"<u>{user}</u>")
    assert repeat == specbench.Workload(
        "repeat", f"<u>{specbench.REPEAT_REQUEST}ONE:\nfirst line\nsecond line\n</u>", True)
    assert free == specbench.Workload("free", f"<u>{specbench.FREE_REQUEST}</u>", True)


def test_a_text_of_one_paragraph_is_refused() -> None:
    with pytest.raises(UsageError, match="two paragraphs"):
        specbench.workloads("just one\n", words, 4)


def run_of(rate: float, ids: List[List[int]], spec: Any = None) -> Dict[str, Any]:
    return {"tokens_per_s": rate, "token_ids": ids, "speculation": spec}


STATS = {"drafted": 10, "accepted": 6, "verify_steps": 4, "tokens_per_pass": 2.5}


@pytest.mark.parametrize("plain, spec, speedup, same", [
    ([run_of(10, [[1]])], [run_of(20, [[1]], STATS)], 2.0, True),
    ([run_of(10, [[1]]), run_of(30, [[1]]), run_of(20, [[1]])],  # medians: 20 and 10
     [run_of(5, [[1]], STATS), run_of(10, [[1]], STATS), run_of(40, [[1]], STATS)], 0.5, True),
    ([run_of(10, [[1, 2]])], [run_of(10, [[1, 3]], STATS)], 1.0, False),  # one token differs
    ([run_of(10, [[1], [2]])], [run_of(10, [[1], [2]], STATS)], 1.0, True),
    ([run_of(10, [[1], [2]]), run_of(10, [[1], [3]])], [run_of(10, [[1], [2]], STATS)] * 2,
     1.0, False),  # two plain runs differ
])
def test_a_row_from_its_runs(plain: List[Dict[str, Any]], spec: List[Dict[str, Any]],
                             speedup: float, same: bool) -> None:
    row = specbench.compare(3, "repeat", {"plain": plain, "spec": spec})
    assert row["nodes"] == 3 and row["workload"] == "repeat"
    assert row["speedup"] == speedup and row["same_text"] is same
    n = len(spec)
    assert (row["drafted"], row["accepted"], row["verify_steps"]) == (10 * n, 6 * n, 4 * n)
    assert row["acceptance"] == 0.6 and row["tokens_per_pass"] == 2.5
    assert row["runs"] == {"plain": [r["tokens_per_s"] for r in plain],
                           "spec": [r["tokens_per_s"] for r in spec]}


def test_a_row_where_nothing_was_drafted() -> None:
    row = specbench.compare(1, "free", {"plain": [run_of(10, [[1]])],
                                        "spec": [run_of(10, [[1]], {})]})
    assert (row["drafted"], row["acceptance"], row["tokens_per_pass"]) == (0, 0.0, 0.0)


def test_the_order_alternates_and_the_rings_are_one_process_and_the_largest() -> None:
    assert [tuple(specbench.order(r)) for r in range(3)] == [
        ("plain", "spec"), ("spec", "plain"), ("plain", "spec")]
    assert specbench.ring_sizes(1) == [1] and specbench.ring_sizes(3) == [1, 3]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MDIEDGE, "bench", "--model", str(NANOLLAMA),
                           "--samples", "2", "--new-tokens", "12", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_real_run_reports_both_ways_and_equal_texts() -> None:
    done = bench("--nodes", "2", "--speculate", "ngram", "--repeat", "2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["speculate"] == "ngram" and "ngram against plain" in result["title"]
    rows = result["results"]
    assert [(r["nodes"], r["workload"]) for r in rows] == [
        (1, "repeat"), (1, "free"), (2, "repeat"), (2, "free")]
    for row in rows:
        assert row["same_text"] is True, row
        assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
        assert row["speedup"] == pytest.approx(
            row["spec_tokens_per_s"] / row["plain_tokens_per_s"], rel=0.01)
        assert len(row["runs"]["plain"]) == len(row["runs"]["spec"]) == 2
    repeat = rows[0]
    assert repeat["accepted"] > 0 and repeat["tokens_per_pass"] > 1.0
    assert rows[2]["accepted"] == repeat["accepted"]  # greedy: the same drafts on any ring


def test_the_table_names_its_columns_and_a_row_per_workload() -> None:
    done = bench("--nodes", "1", "--speculate", "ngram")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "ngram against plain" in lines[0]
    assert lines[1].split() == ["nodes", "workload", "plain", "tok/s", "spec", "tok/s", "ratio",
                                "acceptance", "tokens/pass", "same", "text"]
    assert [line.split()[:2] for line in lines[2:]] == [["1", "repeat"], ["1", "free"]]
    assert all(line.split()[-1] == "yes" for line in lines[2:])


@pytest.mark.parametrize("args, quoted", [
    (["--speculate", "bigram"], "'bigram'"),
    (["--speculate", "ngram", "--text", "/nonexistent/text"], "/nonexistent/text"),
    (["--speculate", "ngram", "--preset", "nanollama-304m"], "'nanollama-304m'"),
])
def test_bad_input_is_refused_in_one_line(args: List[str], quoted: str) -> None:
    done = bench("--nodes", "1", *args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mdiedge: error: ") and quoted in lines[0]
