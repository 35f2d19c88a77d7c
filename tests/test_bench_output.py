"""``mdiedge bench`` shows each configuration as soon as it is measured: the table's header
first, then one row per configuration on stdout, and what it is measuring on stderr while it
waits; ``--json`` prints one object at the end."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from mdiedge.tools import bench as benchmarks
from mdiedge.tools.benchtable import (COLUMNS, RANGE_COLUMN, column_widths, columns, format_line,
                                    row_cells)
from mdiedge.tools.roofline import Roofline
from commands import MDIEDGE


def figures(nodes: int, micro_batch: int) -> Dict[str, Any]:
    return {"nodes": nodes, "micro_batch": micro_batch, "tokens_per_s": 12.34,
            "decode_tokens_per_s": 14.56,
            "busy_fraction": [0.5] * nodes, "hop_overhead_us": None if nodes == 1 else 250.4,
            "expert_load": {}, "peak_rss_bytes": [300 << 20] * nodes,
            "weight_kv_bytes": [100 << 20] * nodes, "read_bytes": [50 << 20] * nodes,
            "threads": 1}


def fake_roofline() -> Roofline:
    return Roofline(lambda nbytes, threads, concurrent: 1e9 / concurrent)


@pytest.mark.parametrize("max_nodes, samples, expected", [
    (1, 1, [(1, 1)]),
    (2, 1, [(1, 1), (2, 1)]),
    (3, 3, [(1, 1), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1), (3, 3)]),
])
def test_configurations(max_nodes: int, samples: int, expected: List[Tuple[int, int]]) -> None:
    assert benchmarks.configurations(max_nodes, samples) == expected


def test_row_cells() -> None:
    result = figures(2, 1)
    result.update(fake_roofline().figures(result, 2))
    # 2 messages per round through 2 nodes of 50 MiB, each at 0.5 GB/s: 0.2097 s a round
    assert row_cells(result) == ["2", "1", "12.3", "14.6", "9.5", "153%", "0.50 0.50", "250",
                                 "300 300", "200 200"]
    assert row_cells(figures(1, 1))[3:7] == ["14.6", "-", "-", "0.50"]


def test_widths_hold_the_largest_ring() -> None:
    widths = column_widths(8)
    cells = row_cells(figures(8, 1))
    assert all(len(cell) <= width for cell, width in zip(cells, widths))
    assert len(format_line(COLUMNS, widths)) == len(format_line(cells, widths))


def test_run_all_yields_each_configuration_before_the_next_runs(tiny_llama: Path) -> None:
    calls: List[Tuple[int, int]] = []
    waits: List[str] = []

    def runner(path: Path, nodes: int, samples: int, new_tokens: int, context: int,
               micro_batch: int) -> Dict[str, Any]:
        assert path == tiny_llama and (samples, new_tokens, context) == (2, 4, 16)
        calls.append((nodes, micro_batch))
        return figures(nodes, micro_batch)

    from contextlib import contextmanager

    @contextmanager
    def measuring(what: str) -> Any:
        waits.append(what)
        yield

    measured = benchmarks.run_all(str(tiny_llama), None, 2, 2, 4, 16, runner, measuring,
                                  fake_roofline())
    assert calls == []
    assert next(measured)["nodes"] == 1 and calls == [(1, 1)]
    assert waits == ["measuring 1 of 4: 1 node, 1 sample per message",
                     "measuring the read bandwidth of 1 node"]
    assert [r["micro_batch"] for r in measured] == [2, 1, 2] and len(calls) == 4
    assert waits[-2] == "measuring 4 of 4: 2 nodes, 2 samples per message"


def rated(decode: float, limit: float = 100.0) -> Dict[str, Any]:
    return {**figures(1, 1), "decode_tokens_per_s": decode, "roofline_tokens_per_s": limit,
            "roofline_share": decode / limit, "read_bytes_per_s": limit * 1e7}


@pytest.mark.parametrize("rates, chosen", [
    ([7.0], 7.0),
    ([3.0, 1.0, 2.0], 2.0),
    ([4.0, 1.0, 3.0, 2.0], 2.0),  # an even count: the lower middle, a run that happened
    ([5.0, 5.0, 1.0], 5.0),
])
def test_median_run(rates: List[float], chosen: float) -> None:
    result = benchmarks.median_run([rated(r) for r in rates])
    assert result["decode_tokens_per_s"] == chosen and result["roofline_share"] == chosen / 100
    assert [run["decode_tokens_per_s"] for run in result["runs"]] == rates  # in run order
    assert set(result["runs"][0]) == {"tokens_per_s", "decode_tokens_per_s", "roofline_share",
                                      "roofline_tokens_per_s", "read_bytes_per_s",
                                      "hop_overhead_us"}
    with pytest.raises(ValueError, match="no runs"):
        benchmarks.median_run([])


def test_the_median_runs_share_is_of_the_median_probe() -> None:
    """The probes swing more than the decode: the median run's share is of the median
    limit, and every run keeps its own."""
    result = benchmarks.median_run([rated(3.0, 100.0), rated(1.0, 50.0), rated(2.0, 400.0)])
    assert result["decode_tokens_per_s"] == 2.0 and result["roofline_tokens_per_s"] == 100.0
    assert result["roofline_share"] == pytest.approx(0.02)
    assert result["read_bytes_per_s"] == 100.0 * 1e7
    assert [run["roofline_share"] for run in result["runs"]] == [0.03, 0.02, 0.005]


def test_run_all_repeats_each_configuration_with_its_own_probe(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rates = iter([30.0, 10.0, 20.0, 5.0, 6.0, 4.0])
    probes: List[int] = []
    waits: List[str] = []

    def runner(*args: Any) -> Dict[str, Any]:
        return {**figures(args[1], args[5]), "decode_tokens_per_s": next(rates)}

    def probe(nbytes: int, threads: int, concurrent: int) -> float:
        probes.append(nbytes)
        return 1e9

    from contextlib import contextmanager

    @contextmanager
    def measuring(what: str) -> Any:
        waits.append(what)
        yield

    monkeypatch.setattr(benchmarks, "Roofline", lambda: Roofline(probe))
    measured = list(benchmarks.run_all(str(tiny_llama), None, 1, 3, 4, 16, runner, measuring,
                                       repeat=3))
    assert [r["decode_tokens_per_s"] for r in measured] == [20.0, 5.0]
    assert [[run["decode_tokens_per_s"] for run in r["runs"]] for r in measured] == [
        [30.0, 10.0, 20.0], [5.0, 6.0, 4.0]]
    assert "measuring 1 of 2: 1 node, 1 sample per message, run 2 of 3" in waits
    # both configurations read the same bytes on one node: one probe per run, not per config
    assert len(probes) == 3
    with pytest.raises(ValueError, match="repeat 0 is not >= 1"):
        next(benchmarks.run_all(str(tiny_llama), None, 1, 1, 4, 16, runner, repeat=0))


def test_repeated_rows_show_the_range() -> None:
    result = benchmarks.median_run([rated(r) for r in (3.0, 1.0, 2.0)])
    cells, widths = row_cells(result), column_widths(2, repeat=3)
    names = columns(3)
    assert names[names.index("decode tok/s") + 1] == RANGE_COLUMN and columns(1) == COLUMNS
    assert cells[names.index("decode tok/s")] == "2.0"
    assert cells[names.index(RANGE_COLUMN)] == "1.0–3.0"
    assert len(cells) == len(names) == len(widths)


def _bench(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, as_json: bool,
           **options: Any) -> Tuple[List[str], str, str]:
    """Runs the command with a fake runner; stdout as it stood at each configuration's start."""
    from mdiedge.cli.bench import bench

    seen: List[str] = []
    printed: List[str] = []

    def runner(path: Path, nodes: int, samples: int, new_tokens: int, context: int,
               micro_batch: int) -> Dict[str, Any]:
        out, err = capsys.readouterr()
        printed.append(out)
        seen.append("".join(printed))
        sys.stderr.write(err)  # kept for the final check
        return figures(nodes, micro_batch)

    monkeypatch.setattr(benchmarks, "run_subprocess", runner)
    monkeypatch.setattr(benchmarks, "Roofline", fake_roofline)
    bench(model=None, preset=None, nodes=2, samples=1, new_tokens=4, context=16, micro_batch=1,
          one=False, as_json=as_json, compression=None, text=None, eval_tokens=0, **options)
    out, err = capsys.readouterr()
    return seen, "".join(printed) + out, err


def test_cli_prints_the_header_first_then_each_row_as_measured(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    seen, out, err = _bench(capsys, monkeypatch, False)
    lines = out.splitlines()
    assert lines[0] == "nanollama: 1 samples x 4 tokens, context 16"
    assert lines[1].split() == "nodes samples/msg tok/s decode tok/s limit tok/s share busy " \
                               "fraction per node hop µs peak RSS MB per node RSS − (weights+KV) MB".split()
    assert len(lines) == 5
    assert seen[0].splitlines() == lines[:3]  # the header, before the first configuration
    assert seen[1].splitlines() == lines[:4]  # the first row, before the second one runs
    assert lines[3].split()[:3] == ["1", "1", "12.3"] and lines[4].split()[:3] == ["2", "1", "12.3"]
    assert "bench: measuring 1 of 2: 1 node, 1 sample per message" in err
    assert "bench: measuring 2 of 2: 2 nodes, 1 sample per message" in err


def test_cli_json_is_one_object_at_the_end(capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seen, out, err = _bench(capsys, monkeypatch, True)
    assert seen == ["", ""]
    result = json.loads(out)
    assert [r["nodes"] for r in result["results"]] == [1, 2]
    assert result["title"] == "nanollama: 1 samples x 4 tokens, context 16"


def test_a_real_run_prints_rows_before_it_ends(ring_model: Path) -> None:
    """The command as a user runs it: the first row is on stdout while the next runs."""
    proc = subprocess.Popen([*MDIEDGE, "bench", "--model", str(ring_model),
                             "--nodes", "2", "--samples", "1", "--new-tokens", "2",
                             "--context", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(4)]  # title, header, rule, first row
    first_row_at = time.monotonic()
    rest, err = proc.communicate(timeout=180)
    ended_at = time.monotonic()
    assert proc.returncode == 0, err
    assert lines[3].split()[:2] == ["1", "1"] and rest.split()[:2] == ["2", "1"]
    assert ended_at - first_row_at > 0.5  # the second configuration ran after the first row
    assert "bench: measuring 2 of 2: 2 nodes, 1 sample per message" in err


@pytest.mark.parametrize("read, samples, micro, bandwidth, expected", [
    ([100], 3, 1, 100.0, 1.0),        # one node, three messages a round
    ([100], 3, 3, 100.0, 3.0),        # one node, one message for all three
    ([50, 50], 3, 1, 50.0, 1.0),      # three messages: each node reads 150 a round
    ([50, 50], 3, 2, 50.0, 1.5),      # two messages: 100 a node
    ([50, 50], 3, 3, 100.0, 3.0),     # one message: its trip reads 100
    ([20, 80], 2, 1, 40.0, 0.5),      # the larger node sets the pace
])
def test_limit_tokens_per_s(read: List[int], samples: int, micro: int, bandwidth: float,
                            expected: float) -> None:
    from mdiedge.tools.roofline import limit_tokens_per_s

    assert limit_tokens_per_s(read, samples, micro, bandwidth) == pytest.approx(expected)


@pytest.mark.parametrize("read, kv, samples, micro, bandwidth, expected", [
    ([100], [10], 1, 1, 110.0, 1.0),          # one row: weights and its cache
    ([100], [10], 3, 3, 130.0, 3.0),          # one message of three rows: three caches
    ([100], [10], 3, 1, 330.0, 3.0),          # three messages: the weights three times
    ([50, 50], [5, 5], 3, 3, 130.0, 3.0),     # one message's trip: both nodes, three rows
    ([50, 50], [5, 5], 3, 1, 165.0, 3.0),     # busiest node: 3 x 50 + 3 x 5
    ([20, 80], [0, 10], 2, 1, 180.0, 2.0),    # the larger node sets the pace
    ([100], [0], 3, 1, 100.0, 1.0),           # no cache read: as without
])
def test_limit_counts_each_rows_kv_cache(read: List[int], kv: List[int], samples: int,
                                         micro: int, bandwidth: float, expected: float) -> None:
    from mdiedge.tools.roofline import limit_tokens_per_s

    assert limit_tokens_per_s(read, samples, micro, bandwidth, kv) == pytest.approx(expected)


@pytest.mark.parametrize("prompt, new, expected", [
    (0, 1, 0.5), (128, 128, 192.0), (3, 800, 403.0), (10, 2, 11.0)])
def test_mean_keys(prompt: int, new: int, expected: float) -> None:
    """Decode messages k = 1 .. new - 1 attend over prompt + k keys: their mean."""
    from mdiedge.tools.roofline import mean_keys

    assert mean_keys(prompt, new) == expected
    if new > 1:
        keys = [prompt + k for k in range(1, new)]
        assert sum(keys) / len(keys) == expected


@pytest.mark.parametrize("call, match", [
    (lambda f: f.mean_keys(-1, 4), "prompt of -1"),
    (lambda f: f.mean_keys(4, 0), "0 new tokens"),
    (lambda f: f.limit_tokens_per_s([100], 1, 1, 1.0, [1, 2]), r"KV bytes \[1, 2\]"),
    (lambda f: f.limit_tokens_per_s([100], 0, 1, 1.0), "0 samples"),
    (lambda f: f.limit_tokens_per_s([100], 1, 1, 0.0), "bandwidth 0.0"),
])
def test_limit_refuses_bad_input(call: Any, match: str) -> None:
    from mdiedge.tools import roofline

    with pytest.raises(ValueError, match=match):
        call(roofline)


def test_figures_take_the_kv_cache_into_the_limit() -> None:
    result = figures(1, 1)
    plain = fake_roofline().figures(result, 1)["roofline_tokens_per_s"]
    result["kv_read_bytes"] = [50 << 20]  # as much cache per row as weights
    assert fake_roofline().figures(result, 1)["roofline_tokens_per_s"] == pytest.approx(plain / 2)


@pytest.mark.parametrize("nodes, samples, micro, expected", [
    (1, 3, 1, 1), (2, 3, 1, 2), (3, 3, 3, 1), (3, 4, 2, 2), (4, 8, 1, 4)])
def test_concurrency(nodes: int, samples: int, micro: int, expected: int) -> None:
    from mdiedge.tools.roofline import concurrency

    assert concurrency(nodes, samples, micro) == expected


@pytest.mark.parametrize("read, concurrent, expected", [
    ([50], 1, 50),
    ([50, 50], 2, 50),       # every node busy: each process reads one node's bytes
    ([50, 50], 1, 100),      # one message around the ring: the whole ring's bytes
    ([20, 80], 1, 100),
    ([20, 80], 2, 80),       # the largest node's, when the share is smaller
    ([30, 30, 31], 2, 46),   # the share, rounded up
])
def test_probe_bytes_hold_the_rings_working_set(read: List[int], concurrent: int,
                                                expected: int) -> None:
    from mdiedge.tools.roofline import probe_bytes

    assert probe_bytes(read, concurrent) == expected


def test_a_local_ring_with_one_message_probes_all_its_bytes() -> None:
    calls: List[Tuple[int, int, int]] = []
    Roofline(lambda b, t, c: calls.append((b, t, c)) or 1e9).figures(figures(3, 1), 1)
    assert calls == [(150 << 20, 1, 1)]


def test_roofline_measures_each_shape_once() -> None:
    calls: List[Tuple[int, int, int]] = []
    roofline = Roofline(lambda b, t, c: calls.append((b, t, c)) or 1e9)
    for _ in range(2):
        roofline.figures(figures(2, 1), 3)
    assert calls == [(50 << 20, 1, 2)]


def test_read_bandwidth_measures_a_real_product() -> None:
    from mdiedge.tools.roofline import read_bandwidth

    assert 1e8 < read_bandwidth(4 << 20, 1, 2, seconds=0.1) < 1e13
    assert 1e8 < read_bandwidth(4 << 20, 1, 1, seconds=0.1) < 1e13
    with pytest.raises(ValueError, match="threads 0"):
        read_bandwidth(4 << 20, 0)


def test_cli_repeat_shows_the_median_run_and_the_range(capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen, out, err = _bench(capsys, monkeypatch, False, repeat=2)
    lines = out.splitlines()
    assert lines[0] == "nanollama: 1 samples x 4 tokens, context 16, median of 2 runs"
    assert RANGE_COLUMN in lines[1]
    assert len(lines) == 5 and lines[3].split()[3:5] == ["14.6", "14.6–14.6"]
    assert "bench: measuring 2 of 2: 2 nodes, 1 sample per message, run 2 of 2" in err


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_run_reports_each_nodes_kv_cache_read(ring_model: Path, nodes: int) -> None:
    """Every node's KV bytes per row of a message: its blocks' keys and values (fp32) over
    the generation's mean keys, the whole model's between them."""
    from mdiedge.model.checkpoint import load_config
    from mdiedge.tools.roofline import mean_keys

    cfg = load_config(ring_model)
    result = benchmarks.run_config(ring_model, nodes, 2, 8, 24, 2, pings=5)
    kv = result["kv_read_bytes"]
    assert len(kv) == nodes and all(k > 0 for k in kv)
    per_block = 2 * cfg.kv_dim * 4 * mean_keys(24 - 8, 8)
    assert sum(kv) == pytest.approx(cfg.n_layers * per_block)
    assert all(k / per_block == round(k / per_block) for k in kv)
