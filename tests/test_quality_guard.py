"""The quality guard of link compression: the split forward with codec ``none`` is the model's
own forward, a codec's hops change the hidden states within its bound, and the figures of
``agreement`` are consistent; the command refuses bad values in one line."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from mdiedge.base.codecs import FP16, INT8, NONE, Compression
from mdiedge.model.checkpoint import load_model
from mdiedge.tools.quality import agreement, round_trip, stage_ranges, teacher_forced
from commands import MDIEDGE


@pytest.fixture(scope="module")
def model(ring_model: Path) -> torch.nn.Module:
    return load_model(ring_model)


def test_round_trip_is_the_links_codec() -> None:
    x = torch.randn(2, 5, 64)
    assert round_trip(x, NONE) is x
    assert (round_trip(x, FP16) - x).abs().max() <= 1e-3 * x.abs().max()
    assert 0 < (round_trip(x, INT8) - x).abs().max() <= x.abs().max() / 126


def test_the_splits_are_the_rings(model: torch.nn.Module) -> None:
    ranges = stage_ranges(model.cfg, 3, 64)
    assert ranges[0][0] == 0 and ranges[-1][1] == model.cfg.n_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and len(ranges) == 3


def test_split_forward_without_codec_is_the_models_forward(model: torch.nn.Module) -> None:
    tokens = list(range(3, 40))
    preds, nlls = teacher_forced(model, tokens, stage_ranges(model.cfg, 3, 64), NONE, 16)
    with torch.no_grad():
        logits = torch.cat([model.head_logits(model._run_blocks_uncached(
            model.embed_tokens(torch.tensor(tokens[s:s + 16])[None])))[0]
            for s in range(0, len(tokens) - 1, 16)])[:len(tokens) - 1]
    assert torch.equal(preds, logits.argmax(-1)) and nlls.shape == (len(tokens) - 1,)


def test_agreement_figures(model: torch.nn.Module) -> None:
    tokens = [(7 * i) % 50 + 3 for i in range(80)]
    ranges = stage_ranges(model.cfg, 3, 64)
    same = agreement(model, tokens, ranges, Compression("none"), 32)
    assert same["top1_agreement"] == 1.0 and same["perplexity_change"] == 0.0
    int8 = agreement(model, tokens, ranges, Compression("fp16", "int8"), 32)
    assert int8["codec"] in ("fp16", "int8") and 0.5 < int8["top1_agreement"] <= 1.0
    assert int8["tokens"] == 79 and int8["perplexity"] > 1


@pytest.mark.parametrize("args,message", [
    (["--compression", "int4"], "--compression 'int4' is not a codec"),
    (["--compression", "int8", "--text", "/nonexistent"], "--text: expected a text file"),
])
def test_bad_guard_options_are_one_line(args: list, message: str) -> None:
    done = subprocess.run([*MDIEDGE, "bench", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr
    assert "Traceback" not in done.stderr
