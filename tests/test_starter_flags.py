"""The starter's ring options from a file and from the command line: ``recover`` and
``prefill_chunk`` of a ring file hold unless ``--recover/--no-recover`` or ``--prefill-chunk``
is given (an explicit flag wins, even with the default's value); ``mdiedge starter`` passes
every ``[starter]`` option of its config into the ring (``quantize`` included, ``--quantize``
winning); and the prefill chunk a ring uses."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import pytest

from mdiedge.base import defaults
from mdiedge.base.settings import load_settings
from mdiedge.base.engineoptions import EngineOptions, canonical_quantizer
from mdiedge.cli.app import engine_spec
from mdiedge.engine.opening import open_engine
from mdiedge.cli.nodes import _starter_engine

from conftest import FakeEngine
from mdiedge.roles.starter import ring_message_rows
from mdiedge.runtime.scheduler import prefill_rows


def ring_file(tmp_path: Path, starter_lines: str) -> Path:
    path = tmp_path / "ring.toml"
    path.write_text(f'[starter]\n{starter_lines}[[workers]]\nhost = "127.0.0.1"\n'
                    f'control_port = 7700\n')
    return path


def test_absent_flags_change_nothing() -> None:
    assert EngineOptions().checked().given_ring_options() == {}
    given = EngineOptions(stall_timeout=2.0, recover=False, spares=1, compression="int8",
                          prefill_chunk=0, quantize="q8_0", no_encrypt=True,
                          busy_poll_us=0).checked()
    assert given.given_ring_options() == {"stall_s": 2.0, "recover": False,
                                          "compression": "int8", "prefill_chunk": 0,
                                          "quantize": "Q8_0", "encrypt": False,
                                          "busy_poll_us": 0}


@pytest.mark.parametrize("value", [-1, defaults.MAX_BUSY_POLL_US + 1])
def test_a_busy_poll_out_of_range_is_a_usage_error(value: int) -> None:
    from mdiedge.base.errors import UsageError

    with pytest.raises(UsageError) as raised:
        EngineOptions(busy_poll_us=value).checked()
    assert str(raised.value) == (f"--busy-poll-us: expected an integer "
                                 f"0..{defaults.MAX_BUSY_POLL_US}, got {value}")


class FakeLocalRing:
    """Records what a local ring is started with; no process."""
    made: List[Any] = []

    def __init__(self, workers: int, **kwargs: Any) -> None:
        self.kwargs, self.secret = kwargs, None
        FakeLocalRing.made.append(self)

    def __enter__(self) -> List[Any]:
        return []

    def __exit__(self, *exc: Any) -> None:
        pass


@pytest.mark.parametrize("flag,want", [(None, defaults.BUSY_POLL_US), (0, 0), (5000, 5000)])
def test_a_local_ring_polls_as_told(monkeypatch: pytest.MonkeyPatch, ring_model: Path,
                                    fake_engine: List[FakeEngine], flag: Optional[int],
                                    want: int) -> None:
    """``--busy-poll-us`` reaches the local ring's workers and the starter's link back."""
    import mdiedge.roles.local_ring as local_ring

    FakeLocalRing.made = []
    monkeypatch.setattr(local_ring, "LocalRing", FakeLocalRing)
    open_engine(engine_spec(EngineOptions(model=str(ring_model), nodes=3,
                                          busy_poll_us=flag).checked()))
    assert FakeLocalRing.made[0].kwargs.get("busy_poll_us", defaults.BUSY_POLL_US) == want
    assert fake_engine[0].options.busy_poll_us == want


def test_a_negative_prefill_chunk_is_a_usage_error() -> None:
    """Raised, not printed: the command prints it once its progress display is gone."""
    from mdiedge.base.errors import UsageError

    with pytest.raises(UsageError) as raised:
        EngineOptions(prefill_chunk=-1).checked()
    assert str(raised.value) == "--prefill-chunk: expected an integer >= 0, got -1"
    assert raised.value.exit_code == 2


@pytest.mark.parametrize("in_file,flag,want", [
    ("recover = false\n", None, False),  # the file's holds (the old default overrode it)
    ("recover = false\n", True, True),   # an explicit flag wins
    ("", False, False),
    ("", None, True),                    # neither: recovery on
])
def test_generate_ring_merges_recover(tmp_path: Path, ring_model: Path,
                                      fake_engine: List[FakeEngine], in_file: str,
                                      flag: Optional[bool], want: bool) -> None:
    open_engine(engine_spec(EngineOptions(model=str(ring_model), nodes=1, recover=flag,
                                          ring=str(ring_file(tmp_path, in_file))).checked()))
    assert fake_engine[0].options.recover is want


@pytest.mark.parametrize("option,in_file,flag,want", [
    ("prefill_chunk", "prefill_chunk = 32\n", None, 32),
    ("prefill_chunk", "prefill_chunk = 32\n", 0, 0),
    ("prefill_chunk", "", 64, 64),
    ("prefill_chunk", "", None, defaults.PREFILL_CHUNK),
    ("busy_poll_us", "busy_poll_us = 50\n", None, 50),
    ("busy_poll_us", "busy_poll_us = 50\n", 0, 0),
    ("busy_poll_us", "", 3000, 3000),
    ("busy_poll_us", "", None, defaults.BUSY_POLL_US),
])
def test_generate_ring_merges_an_integer_option(tmp_path: Path, ring_model: Path,
                                                fake_engine: List[FakeEngine], option: str,
                                                in_file: str, flag: Optional[int],
                                                want: int) -> None:
    """The ring file's value holds unless the flag is given (0 too); neither: the default."""
    open_engine(engine_spec(EngineOptions(model=str(ring_model), nodes=1,
                                          ring=str(ring_file(tmp_path, in_file)),
                                          **{option: flag}).checked()))
    assert getattr(fake_engine[0].options, option) == want


def test_the_starter_passes_its_config(tmp_path: Path, fake_engine: List[FakeEngine]) -> None:
    path = ring_file(tmp_path, "stall_s = 7.5\nrecover = false\nrebalance_margin = 0\n"
                               "prefill_chunk = 16\ntimeout_s = 9\nquantize = 'q8_0'\n")
    settings = load_settings(path)
    _starter_engine(settings, settings.starter, EngineOptions(), None, "http://127.0.0.1:1")
    options = fake_engine[0].options
    assert (options.stall_s, options.recover, options.rebalance_margin, options.prefill_chunk,
            options.timeout_s, options.quantize) == (7.5, False, 0.0, 16, 9.0, "Q8_0")
    # the command line's --quantize (and --compression) win over the file's
    flags = EngineOptions(compression="int8", quantize="q4_1").checked()
    _starter_engine(settings, settings.starter, flags, None, "http://127.0.0.1:1")
    assert (fake_engine[1].options.quantize, fake_engine[1].options.compression) == (
        "Q4_1", "int8")


@pytest.mark.parametrize("in_file,flag,want", [
    ("quantize = 'q4_0'\n", None, "Q4_0"),
    ("quantize = 'q4_0'\n", "q8_0", "Q8_0"),
    ("", None, ""),
])
def test_generate_ring_merges_quantize(tmp_path: Path, ring_model: Path,
                                       fake_engine: List[FakeEngine], in_file: str,
                                       flag: Optional[str], want: str) -> None:
    open_engine(engine_spec(EngineOptions(model=str(ring_model), nodes=1, quantize=flag,
                                          ring=str(ring_file(tmp_path, in_file))).checked()))
    assert fake_engine[0].options.quantize == want


def test_a_bad_quantize_type_is_a_usage_error() -> None:
    from mdiedge.base.errors import UsageError

    with pytest.raises(UsageError, match=r"--quantize: expected one of q8_0, q4_0, q4_1, "
                                         r"got 'q2_k'"):
        canonical_quantizer("q2_k")


@pytest.mark.parametrize("chunk,max_payload,row_bytes,want", [
    (128, 64 << 20, 1024, 128),   # the chunk
    (0, 64 << 20, 1024, 65536),   # the whole prompt, up to what a frame holds
    (128, 64 * 1024, 1024, 64),   # a frame holds fewer rows than the chunk
    (0, 100, 1024, 1),            # a row larger than a frame: still one row per message
    (1, 64 << 20, 1024, 1),
])
def test_prefill_rows(chunk: int, max_payload: int, row_bytes: int, want: int) -> None:
    assert prefill_rows(chunk, max_payload, row_bytes) == want


def test_the_starter_takes_early_exit(tmp_path: Path, fake_engine: List[FakeEngine]) -> None:
    settings = load_settings(ring_file(tmp_path, ""))
    exits = EngineOptions(early_exit="softmax", exit_threshold="0.25").checked()
    _starter_engine(settings, settings.starter, exits, None, "http://127.0.0.1:1")
    _starter_engine(settings, settings.starter, EngineOptions(), None, "http://127.0.0.1:1")
    chosen = fake_engine[0].kwargs["early_exit"]
    assert chosen.criterion == "softmax" and set(chosen.thresholds[:-1]) == {0.25}
    assert fake_engine[1].kwargs["early_exit"] is None


@pytest.mark.parametrize("chunk,max_payload,want", [
    (16, 1 << 20, (16, 1024)),        # decode messages are bounded by the frame, not the chunk
    (0, 1 << 20, (1024, 1024)),
    (4096, 64 * 1024, (64, 64)),      # a chunk beyond a frame is cut to what a frame holds
])
def testring_message_rows(chunk: int, max_payload: int, want: Any) -> None:
    from types import SimpleNamespace

    from mdiedge.base.nodes import StarterOptions

    options = StarterOptions(prefill_chunk=chunk, max_payload=max_payload)
    assert ring_message_rows(options, SimpleNamespace(dim=256)) == want


@pytest.mark.parametrize("args, message", [
    (["--cors-origins", "*"], "--cors-origins: expected given with --api-port, got '*'"),
    (["--strict-model-name"], "--strict-model-name: expected given with --api-port, got True"),
])
def test_api_flags_without_an_api_port_are_one_line_errors(args: List[str], message: str) -> None:
    import subprocess

    from commands import MDIEDGE

    out = subprocess.run([*MDIEDGE, "starter", *args], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stderr.strip() == f"mdiedge: error: {message}", out.stderr
