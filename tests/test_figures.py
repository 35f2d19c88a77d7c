"""The figures people read: block ranges that cannot look overlapping, counts in the right
number, tokens/s over the generation alone (the ring's set-up apart), and a request's own
link counts through a long-lived starter."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from mdiedge.base.humanize import block_range, plural
from mdiedge.cli.console import print_status, timing_line
from mdiedge.serving.service import link_deltas
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation, Timing
from mdiedge.model.sampling import SamplingParams


def node(name: str, role: str, layers: Any, **more: Any) -> Dict[str, Any]:
    return dict({"name": name, "role": role, "address": f"{name}:7700", "state": "ready",
                 "layers": layers}, **more)


def test_status_shows_half_open_ranges_and_a_starter_without_blocks(capsys: Any) -> None:
    print_status([node("starter", "starter", [0, 0], recoveries=1),
                  node("w1", "worker", [0, 6]), node("w2", "worker", [6, 12])])
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "[0, 6)" in rows["w1"] and "[6, 12)" in rows["w2"]
    assert "none" in rows["starter"] and "0-0" not in out and "0-6" not in out
    assert "starter: 1 recovery from lost workers since it started" in out


def test_ranges_and_counts_read_the_same_everywhere() -> None:
    assert [block_range(r) for r in ([0, 6], (6, 12), [3, 3], None)] == \
        ["[0, 6)", "[6, 12)", "none", "none"]
    assert [plural(n, "recovery", "recoveries") for n in (0, 1, 2)] == \
        ["0 recoveries", "1 recovery", "2 recoveries"]


def test_tokens_per_s_leave_the_set_up_out() -> None:
    timing = Timing(total_s=3.68, setup_s=3.08, new_tokens=7)
    assert abs(timing.tokens_per_s - 7 / 0.6) < 1e-6
    shown = timing.as_dict()
    assert shown["setup_s"] == 3.08 and shown["generation_s"] == 0.6
    assert timing_line(shown) == "[7 tokens in 0.60 s, 11.7 tok/s; set-up 3.08 s]"
    assert timing_line(Timing(total_s=2.0, new_tokens=1).as_dict()) == \
        "[1 token in 2.00 s, 0.5 tok/s]"


@pytest.mark.parametrize("new_tokens, samples, decode_s, rate", [
    (64, 1, 0.63, 63 / 0.63),   # the first token is the prefill's
    (12, 3, 0.5, 9 / 0.5),      # each sample's first
    (2, 3, 0.5, 0.0),           # a sample ended on its first token: none decoded, not less
    (5, 1, 0.0, 0.0),           # no decode time measured
])
def test_the_decode_rate_counts_tokens_after_each_samples_first(
        new_tokens: int, samples: int, decode_s: float, rate: float) -> None:
    """One definition of decode tok/s (``generate --json``, ``bench``, the quality and
    llama.cpp benches read it), apart from ``tokens_per_s``, which counts the prefill's time."""
    timing = Timing(total_s=2.0, prefill_s=1.0, decode_s=decode_s, new_tokens=new_tokens,
                    samples=samples)
    assert timing.decode_tokens_per_s == pytest.approx(rate)
    assert timing.as_dict()["decode_tokens_per_s"] == round(rate, 2)


def test_a_generation_counts_its_samples() -> None:
    assert Generation(ids_request([1, 2], 4, 3, SamplingParams(), 16), ()).timing.samples == 3


def test_a_generation_times_its_set_up_apart() -> None:
    generation = Generation(ids_request([1, 2], 4, 1, SamplingParams(), 16), ())
    generation.started -= 2.0  # as if its ring took 2 s to set up
    generation.mark_set_up()
    timing = generation.finish()
    assert timing.setup_s >= 2.0 and timing.generation_s < 1.0


def links(frames: List[int], size: int = 100) -> List[Dict[str, Any]]:
    names = ["starter", "w1", "starter"]
    return [{"from": a, "to": b, "codec": "none", "frames": f, "bytes": f * size}
            for a, b, f in zip(names, names[1:], frames)]


def test_a_requests_links_are_its_own_not_the_starters_totals() -> None:
    assert link_deltas(links([10, 10]), links([17, 17])) == links([7, 7])
    assert link_deltas([], links([7, 7])) == links([7, 7])  # a ring set up for it
