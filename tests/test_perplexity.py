"""``mdiedge perplexity`` (``mdiedge/tools/perplexity.py``, ``mdiedge/cli/perplexity.py``):
llama-perplexity's windows and estimate as pure functions, checked with tables and a hand
computation; the command on the shipped NanoLlama (its tokenizer adds no BOS) and on a tiny
GGUF file whose tokenizer adds one, its NLL equal to one torch forward of each whole window;
few-row passes never take the prefill's tiles; bad input as one line and status 2; and what
a terminal shows."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from commands import MDIEDGE
from conftest import NANOLLAMA, make_hf_llama
from test_terminal import in_terminal, screen

from mdiedge.base import defaults
from mdiedge.model import qlayers
from mdiedge.tools.perplexity import (Tally, check_tokens, cut_windows, estimate,
                                      scored_per_window, tallied, text_tokens)

HELD_OUT = NANOLLAMA / "tinyshakespeare-heldout.txt"
FIELDS = {"model", "file", "ctx", "batch", "windows", "tokens", "nll", "ppl", "ppl_stderr",
          "cpu_dot", "device", "threads", "seconds", "tokens_per_s"}


@pytest.mark.parametrize("tokens, ctx, chunks, bos, windows", [
    (list(range(10)), 4, None, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # the rest left out
    (list(range(10)), 4, None, 99, [[99, 1, 2, 3], [99, 5, 6, 7]]),  # BOS first in each
    (list(range(10)), 4, 1, 99, [[99, 1, 2, 3]]),
    (list(range(10)), 4, 5, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # --chunks is a bound
    (list(range(8)), 4, None, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (list(range(7)), 4, None, 9, [[9, 1, 2, 3]]),
])
def test_windows_as_llama_perplexity_cuts_them(tokens: List[int], ctx: int,
                                               chunks: Optional[int], bos: Optional[int],
                                               windows: List[List[int]]) -> None:
    assert cut_windows(tokens, ctx, chunks, bos) == windows


class FakeTokenizer:
    bos_id = 1

    def __init__(self, adds_bos: bool) -> None:
        self.adds_bos = adds_bos

    def encode(self, text: str) -> List[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("adds_bos, ids", [(True, [1, 104, 105]), (False, [104, 105])])
def test_the_text_gets_bos_where_the_tokenizer_adds_one(adds_bos: bool, ids: List[int]) -> None:
    assert text_tokens(FakeTokenizer(adds_bos), "hi") == ids


@pytest.mark.parametrize("ctx, scored", [(512, 255), (16, 7), (17, 8), (32, 15)])
def test_the_second_half_of_a_window_is_scored(ctx: int, scored: int) -> None:
    """The logits at positions ctx // 2 .. ctx - 2 (llama-perplexity's ``first`` on)."""
    assert scored_per_window(ctx) == scored


def test_estimate_is_llama_perplexitys_by_hand() -> None:
    """NLLs 1, 2, 3, 4: mean 2.5, mean of squares 7.5, variance 7.5 - 6.25 = 1.25; ppl
    e^2.5 = 12.18249396, its error e^2.5 * sqrt(1.25 / 3) = 12.18249396 * 0.64549722."""
    tally = tallied(tallied(Tally(), [1.0, 2.0]), [3.0, 4.0])
    assert tally == Tally(4, 10.0, 30.0)
    ppl, stderr = estimate(tally)
    assert ppl == pytest.approx(12.18249396, rel=1e-8)
    assert stderr == pytest.approx(7.86376604, rel=1e-8)
    assert estimate(tallied(Tally(), [0.5] * 10)) == (pytest.approx(math.exp(0.5)), 0.0)
    with pytest.raises(ValueError):
        estimate(Tally())


def test_too_few_tokens_for_two_windows_is_a_usage_error() -> None:
    from mdiedge.base.errors import UsageError

    check_tokens(64, 32, "f.txt")
    with pytest.raises(UsageError, match=r"^f.txt: tokenizes to only 63 tokens; --ctx 32 "
                                         r"needs at least 64 \(2 x ctx\)$"):
        check_tokens(63, 32, "f.txt")


def test_the_default_batch_is_the_few_row_kernels() -> None:
    assert defaults.PERPLEXITY_BATCH == qlayers.KERNEL_ROWS
    assert defaults.PERPLEXITY_CTX == 512  # llama-perplexity's -c


@pytest.fixture(scope="module")
def short_text(tmp_path_factory: Any) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(HELD_OUT.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bos_gguf(tmp_path_factory: Any) -> Path:
    """A tiny Q8_0 Llama GGUF file with NanoLlama's vocabulary, its tokenizer adding BOS."""
    from gguf_files import write_gguf

    folder = tmp_path_factory.mktemp("bos-gguf")
    vocab = folder / "vocab"
    vocab.mkdir()
    shutil.copy(NANOLLAMA / "tokenizer.model", vocab)
    config = json.loads((NANOLLAMA / "tokenizer_config.json").read_text())
    (vocab / "tokenizer_config.json").write_text(json.dumps(dict(config, add_bos_token=True)))
    hf = make_hf_llama(folder / "hf", vocab_size=2048, hidden_size=64, intermediate_size=96)
    return write_gguf(folder / "tiny-Q8_0.gguf", hf, "Q8_0", tokenizer=vocab)


def command(*args: str, cpu_dot: str = "f32") -> subprocess.CompletedProcess:
    env = dict(os.environ, MDIEDGE_CPU_DOT=cpu_dot)
    return subprocess.run([*MDIEDGE, "perplexity", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def reference_nll(model: Path, text: Path, ctx: int, chunks: int, bos: bool) -> float:
    """The mean NLL of the same windows, each by one torch forward of the whole window (no
    KV cache), cross entropy of its second half; ``bos``: the text and each window start
    with the BOS token."""
    from mdiedge.model.checkpoint import load_model
    from mdiedge.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    ids = tokenizer.encode(text.read_text(encoding="utf-8"))
    ids = [tokenizer.bos_id] + ids if bos else ids
    net = load_model(model)
    first, nlls = ctx // 2, []
    with torch.no_grad():
        for i in range(min(chunks, len(ids) // ctx)):
            window = torch.tensor(ids[i * ctx:(i + 1) * ctx])
            if bos:
                window[0] = tokenizer.bos_id
            logits = net(window[None], torch.empty(0, dtype=torch.long), [0],
                         all_logits=True)[0]  # (ctx, vocab)
            nlls.append(torch.nn.functional.cross_entropy(
                logits[first:ctx - 1].double(), window[first + 1:], reduction="none"))
    found = torch.cat(nlls)
    assert len(found) == min(chunks, len(ids) // ctx) * (ctx - 1 - first)
    return float(found.mean())


def run_json(model: Path, text: Path, *more: str) -> Dict[str, Any]:
    done = command("--model", str(model), str(text), "--ctx", "32", "--chunks", "2",
                   "--threads", "1", "--json", *more)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress output with --json
    return json.loads(done.stdout)


@pytest.mark.parametrize("which, bos", [("nanollama", False), ("gguf", True)])
def test_the_nll_is_one_forward_of_each_window(which: str, bos: bool, short_text: Path,
                                               bos_gguf: Path) -> None:
    """With --cpu-dot f32 the KV-cache passes of 8 positions score what one forward of the
    whole window scores (within 1e-4)."""
    model = NANOLLAMA if which == "nanollama" else bos_gguf
    result = run_json(model, short_text)
    assert set(result) == FIELDS
    assert (result["ctx"], result["batch"], result["windows"], result["tokens"]) == \
        (32, 8, 2, 2 * 15)
    assert result["cpu_dot"] == "f32" and result["threads"] == 1
    assert Path(result["model"]).resolve() == model.resolve()
    assert result["file"] == str(short_text)
    expected = reference_nll(model, short_text, 32, 2, bos)
    assert result["nll"] == pytest.approx(expected, rel=1e-4)
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]), rel=1e-12)
    assert 0 < result["ppl_stderr"] < result["ppl"]
    assert result["tokens_per_s"] > 0 and result["seconds"] >= 0


def test_cpu_dot_is_set_and_reported(short_text: Path) -> None:
    """--cpu-dot wins over $MDIEDGE_CPU_DOT, which holds without it."""
    assert run_json(NANOLLAMA, short_text, "--cpu-dot", "q8")["cpu_dot"] == "q8"
    done = command("--model", str(NANOLLAMA), str(short_text), "--ctx", "32", "--chunks", "1",
                   "--json", cpu_dot="q8")
    assert done.returncode == 0 and json.loads(done.stdout)["cpu_dot"] == "q8"


def test_few_row_passes_never_take_the_prefill_tiles(monkeypatch: pytest.MonkeyPatch,
                                                     bos_gguf: Path) -> None:
    """--batch 8: every quantized product of a window is a few-row kernel's; --batch 32: the
    blocks take the prefill's de-quantized tiles, the same NLLs within float32 rounding."""
    from mdiedge.engine.engine import TextModel
    from mdiedge.tools.perplexity import Measurement, open_model

    text = TextModel(bos_gguf)
    windows = Measurement.__new__(Measurement)
    windows.text_model, windows.file, windows.ctx = text, Path("-"), 32
    windows.windows = [list(range(3, 35)), list(range(40, 72))]
    net = open_model(text, "cpu", 1, torch_model=True)
    tiled: List[int] = []
    original = qlayers.QuantLinear._tiled

    def counted(self: Any, flat: torch.Tensor, out: torch.Tensor) -> None:
        tiled.append(flat.shape[0])
        original(self, flat, out)

    monkeypatch.setattr(qlayers.QuantLinear, "_tiled", counted)
    few = windows.run(net, 8)
    assert tiled == []
    whole = windows.run(net, 32)
    from mdiedge.model import _pystep
    from mdiedge.model.kernels import STEP

    twin_head = {15} if STEP.select() is _pystep else set()  # the step's calls take them
    assert tiled and set(tiled) == {32} | twin_head  # the blocks' 32 rows, the head's 15
    assert few["tokens"] == whole["tokens"] == 2 * 15
    assert few["nll"] == pytest.approx(whole["nll"], rel=1e-5)


@pytest.mark.parametrize("args, error", [
    (["nope.txt"], "FILE: expected a text file, got 'nope.txt'"),
    (["TEXT", "--ctx", "8"], "--ctx: expected an integer >= 16, got 8"),
    (["TEXT", "--chunks", "0"], "--chunks: expected an integer >= 1, got 0"),
    (["TEXT", "--ctx", "32", "--batch", "33"], "--batch: expected an integer 1..32 (--ctx), got 33"),
    (["TEXT", "--cpu-dot", "q4"], "--cpu-dot: expected one of q8, f32, got 'q4'"),
    (["TEXT", "--threads", "-1"], "--threads: expected an integer 0..4096, got -1"),
    (["TEXT", "--ctx", "2048"], "--ctx: expected an integer 16..1024 (the model's context), "
                                "got 2048"),
    (["TEXT"], "TEXT: tokenizes to only 1002 tokens; --ctx 512 needs at least 1024 (2 x ctx)"),
    (["BINARY"], "BINARY: not UTF-8 text (invalid start byte at byte 2)"),
])
def test_bad_input_is_one_line_and_status_2(args: List[str], error: str, short_text: Path,
                                            tmp_path: Path) -> None:
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"ab\xff\xfe")
    names = {"TEXT": str(short_text), "BINARY": str(binary)}
    done = command(*[names.get(a, a) for a in args])
    for name, path in names.items():
        error = error.replace(name, path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"mdiedge: error: {error}"], done.stderr
    assert done.stdout == ""


def test_a_terminal_shows_a_bar_then_one_result_line() -> None:
    """The bar while the windows are scored (on stderr, gone at the end), then the result
    line alone; with --json, the object alone."""
    args = ["perplexity", str(HELD_OUT), "--ctx", "256", "--chunks", "6", "--threads", "1"]
    raw = in_terminal(args)
    assert "━" in raw and "scoring" in raw, raw
    lines = [line for line in screen(raw) if line]
    assert len(lines) == 1, (lines, raw)
    assert lines[0].startswith("PPL = ") and "over 762 tokens (6 windows of 256, cpu-dot" \
        in lines[0], lines
    raw = in_terminal(args + ["--chunks", "2", "--json"])
    lines = [line for line in screen(raw) if line]
    assert len(lines) == 1 and "━" not in raw and json.loads(lines[0])["windows"] == 2, raw


def test_help_names_the_file_argument() -> None:
    done = subprocess.run([*MDIEDGE, "perplexity", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[0].endswith(
        "perplexity [OPTIONS] FILE"), done.stdout


def test_the_torch_free_node_scores_few_rows_in_the_step(monkeypatch: pytest.MonkeyPatch,
                                                        bos_gguf: Path) -> None:
    """On a CPU the node ``generate`` runs scores (the torch-free CpuModel): --batch 8 never
    takes the numpy prefill where the compiled step runs (with the twins, every pass does),
    --batch 32 does; both score what the torch model scores (f32 mode: float32 caches, within
    float32 rounding)."""
    from mdiedge.engine.engine import TextModel
    from mdiedge.model import cpumodel, npprefill
    from mdiedge.model.cpumodel import CpuModel
    from mdiedge.tools.perplexity import Measurement, open_model

    text = TextModel(bos_gguf)
    windows = Measurement.__new__(Measurement)
    windows.text_model, windows.file, windows.ctx = text, Path("-"), 32
    windows.windows = [list(range(3, 35)), list(range(40, 72))]
    net = open_model(text, "cpu", 1)
    assert isinstance(net, CpuModel)
    prefills: List[int] = []
    original = npprefill.run_blocks

    def counted(cfg: Any, blocks: Any, caches: Any, tables: Any, rows: Any, calls: Any) -> Any:
        prefills.append(rows.shape[0])
        return original(cfg, blocks, caches, tables, rows, calls)

    monkeypatch.setattr(npprefill, "run_blocks", counted)
    few = windows.run(net, 8)
    assert prefills == ([] if cpumodel._step.PREFERRED else [8] * 8)
    prefills.clear()
    whole = windows.run(net, 32)
    assert prefills == [32, 32]
    torch_model = windows.run(open_model(text, "cpu", 1, torch_model=True), 8)
    assert few["tokens"] == whole["tokens"] == torch_model["tokens"] == 2 * 15
    assert few["nll"] == pytest.approx(torch_model["nll"], rel=1e-5)
    assert whole["nll"] == pytest.approx(torch_model["nll"], rel=1e-5)


def test_cross_entropy_is_torchs_in_double() -> None:
    from mdiedge.tools.perplexity import cross_entropy

    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(3)) * 20
    targets = torch.tensor([0, 10, 3, 3, 7])
    want = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")
    assert cross_entropy(logits.numpy(), targets.numpy()) == pytest.approx(want.tolist(),
                                                                           rel=1e-12)
