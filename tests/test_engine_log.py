"""Every generation leaves one log line: INFO with its size, speed and how its samples ended,
WARNING with the reason when it fails."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, List, Optional

import pytest

from mdiedge.base.errors import RingError
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.engine import Engine, failure_line, summary_line
from mdiedge.engine.local import LocalEngine
from mdiedge.base.request import ids_request
from mdiedge.runtime.generation import Generation, Timing


def generation(n_samples: int, prompt: int, ends: List[Optional[str]],
               tokens: int = 0) -> Generation:
    g = Generation(ids_request(list(range(1, prompt + 1)), 8, n_samples, SamplingParams(), 64), ())
    for sample, reason in zip(g.samples, ends):
        sample.finish_reason, sample.tokens = reason, [5] * tokens
    return g


@pytest.mark.parametrize("n, prompt, ends, timing, line", [
    (1, 3, ["length"], Timing(total_s=2.0, new_tokens=8),
     "generation 7: 1 sample, prompt 3 tokens, 8 new tokens in 2.00 s (4.0 tok/s); "
     "finished: length 1"),
    (3, 5, ["eos", "length", "eos"], Timing(total_s=0.5, new_tokens=11),
     "generation 7: 3 samples, prompt 5 tokens, 11 new tokens in 0.50 s (22.0 tok/s); "
     "finished: eos 2, length 1"),
    (2, 1, ["stop", None], Timing(total_s=0.0, new_tokens=0),
     "generation 7: 2 samples, prompt 1 token, 0 new tokens in 0.00 s (0.0 tok/s); "
     "finished: stop 1, unfinished 1"),
])
def test_summary_line(n: int, prompt: int, ends: List[Optional[str]], timing: Timing,
                      line: str) -> None:
    assert summary_line(7, generation(n, prompt, ends), timing) == line


def test_failure_line_names_the_error_on_one_line() -> None:
    line = failure_line(4, generation(2, 3, [None, None], tokens=2),
                        RingError("w2 (127.0.0.1:7700)\nfroze"))
    assert line.startswith("generation 4 failed after ")
    assert line.endswith(" s (2 samples, prompt 3 tokens, 4 new tokens): RingError: "
                         "w2 (127.0.0.1:7700) froze")


def test_an_interrupted_generation_says_so() -> None:
    line = failure_line(1, generation(1, 2, [None]), KeyboardInterrupt())
    assert line.endswith(" s (1 sample, prompt 2 tokens, 0 new tokens): KeyboardInterrupt")


def test_a_finished_generation_logs_one_info_line(stories: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    caplog.set_level(logging.INFO, logger="mdiedge.engine")
    out = engine.generate("Once", 6, 2, SamplingParams(temperature=0))
    lines = [r for r in caplog.records if r.name == "mdiedge.engine"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    text = lines[0].getMessage()
    assert f"2 samples, prompt {len(out.prompt_ids)} tokens, 12 new tokens in " in text
    assert "tok/s); finished: length 2" in text


class _Failing(Engine):
    def __init__(self) -> None:
        self._setup_lock = threading.Lock()

    def prepare(self, n_slots: int, context: int) -> None:  # type: ignore[override]
        raise RingError("worker 'w1' (127.0.0.1:7700) is unreachable")

    def status(self) -> List[Any]:
        return []


def test_a_failed_generation_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mdiedge.engine")
    with pytest.raises(RingError):
        _Failing().run(generation(1, 2, [None]))
    lines = [r for r in caplog.records if r.name == "mdiedge.engine"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "failed after" in lines[0].getMessage()
    assert lines[0].getMessage().endswith(
        "(1 sample, prompt 2 tokens, 0 new tokens): RingError: worker 'w1' (127.0.0.1:7700) is "
        "unreachable")


def test_without_logging_configured_a_failure_prints_nothing() -> None:
    """``mdiedge generate`` configures no logging: its error stays the one line the CLI prints,
    without Python's last-resort copy of the warning."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests'); import test_engine_log as t\n"
            "try:\n    t._Failing().run(t.generation(1, 2, [None]))\n"
            "except Exception as e:\n    print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout == "RingError\n" and out.stderr == "", out.stderr


def test_a_refused_request_logs_one_warning(stories: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    from mdiedge.base.errors import GenerationError

    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    caplog.set_level(logging.INFO, logger="mdiedge.engine")
    with pytest.raises(GenerationError):
        engine.generate("Once", 10 ** 6)
    lines = [r for r in caplog.records if r.name == "mdiedge.engine"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert lines[0].getMessage().startswith("generation refused: prompt of ")
    assert "exceeds the context of" in lines[0].getMessage()


def test_summary_line_names_the_set_up_apart() -> None:
    timing = Timing(total_s=3.5, setup_s=3.0, new_tokens=1)
    assert summary_line(2, generation(1, 2, ["length"]), timing) == (
        "generation 2: 1 sample, prompt 2 tokens, 1 new token in 0.50 s (2.0 tok/s), "
        "set-up 3.00 s; finished: length 1")
