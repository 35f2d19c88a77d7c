"""Stop strings: the pure rules (tables), the per-sample matcher, and a generation that ends
on one, in the engine and on the command line."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mdiedge.base.errors import GenerationError
from mdiedge.cli import app
from mdiedge.model.sampling import SamplingParams
from mdiedge.base.request import MAX_STOPS, check_stops
from mdiedge.model.stopping import (TextOutput, cut_at_stop, find_stop,
                                    streamable)


@pytest.mark.parametrize("text, stops, expected", [
    ("hello world", ["o"], 4),
    ("hello world", ["wor", "ll"], 2),
    ("hello world", ["xyz"], -1),
    ("", ["a"], -1),
    ("abc", [], -1),
])
def test_find_stop(text, stops, expected):
    assert find_stop(text, stops) == expected


@pytest.mark.parametrize("text, stops, expected", [
    ("a cat. The end", ["The end"], ("a cat. ", True)),
    ("a cat", ["dog"], ("a cat", False)),
    ("xx\n\nyy\n\n", ["\n\n"], ("xx", True)),
])
def test_cut_at_stop(text, stops, expected):
    assert cut_at_stop(text, stops) == expected


@pytest.mark.parametrize("text, stops, expected", [
    ("hello", ["xyz"], 5),          # nothing could start a stop
    ("hello wo", ["world"], 6),     # "wo" may grow into "world": held back
    ("hello world!", ["world"], 6),  # found: everything before it
    ("ab", ["abc", "b"], 1),         # "b" is a stop already
    ("aaa", ["aab"], 1),            # the longest suffix that starts a stop is held
    ("", ["a"], 0),
    ("abc", [], 3),
])
def test_streamable(text, stops, expected):
    assert streamable(text, stops) == expected


@pytest.mark.parametrize("bad, message", [
    ([""], "non-empty"),
    ([3], "non-empty"),
    (["x" * 300], "at most 256"),
    (["a"] * (MAX_STOPS + 1), f"at most {MAX_STOPS} strings"),
])
def test_check_stops_refuses(bad, message):
    with pytest.raises(GenerationError, match=message):
        check_stops(bad)


def test_check_stops_takes_one_string():
    assert check_stops("END") == ["END"]


class _Chars:
    """A tokenizer whose tokens are characters."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_matcher_finds_a_stop_split_over_tokens():
    matcher = TextOutput(_Chars(), [ord(">")], ["END"])
    pushed = [matcher.push(ord(c)) for c in "abENxEND"]
    assert pushed == [False] * 7 + [True]
    assert matcher.stopped_at == 5 and matcher.text == "abENxEND"


def test_engine_stops_and_cuts(stories: Path):
    from mdiedge.engine.local import LocalEngine

    engine = LocalEngine(stories / "stories260K.bin", stories / "tok512.model")
    greedy = SamplingParams(temperature=0.0)
    full = engine.generate("Once upon a time", 40, 1, greedy).samples[0]
    stop = full["text"][12:16]
    cut = engine.generate("Once upon a time", 40, 2, greedy, stop=[stop]).samples
    for sample in cut:
        assert sample["finish_reason"] == "stop"
        assert sample["text"] == full["text"][:full["text"].index(stop)]
        assert sample["token_ids"] == full["token_ids"][:len(sample["token_ids"])]
        assert len(sample["token_ids"]) < len(full["token_ids"])


def test_cli_stop_streams_nothing_of_the_stop(stories: Path):
    args = ["generate", "Once upon a time", "-n", "40", "--nodes", "1", "--temperature", "0",
            "--model", str(stories / "stories260K.bin"), "--tokenizer",
            str(stories / "tok512.model")]
    runner = CliRunner()
    full = runner.invoke(app, args)
    assert full.exit_code == 0, full.output
    text = full.stdout.splitlines()[0]
    stop = text[30:34]
    cut = runner.invoke(app, args + ["--stop", "zzzz", "--stop", stop])
    assert cut.exit_code == 0, cut.output
    assert cut.stdout.splitlines()[0] == text[:text.index(stop)]
    bad = runner.invoke(app, args + ["--stop", ""])
    assert bad.exit_code != 0 and "stop: expected non-empty strings" in bad.output
