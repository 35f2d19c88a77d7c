"""``mdiedge perplexity``: a text's perplexity under a model, in this process, its windows
scored as llama.cpp's ``llama-perplexity`` scores them (``mdiedge.tools.perplexity``)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Optional

import typer

from ..base import defaults
from ..base.threads import compute_threads
from ..base.torchcheck import require_torch
from ..base.humanize import plural
from ..base.engineoptions import EngineOptions, check_cpu_dot, check_device, check_threads
from .app import (app, engine_option, engine_spec, need, one_line_errors, open_text_model,
                  terminate_gracefully)
from .usage import ArgumentsCommand


@app.command(cls=ArgumentsCommand)
@one_line_errors
def perplexity(
    file: str = typer.Argument(..., metavar="FILE", help="UTF-8 text to score: at least 2 x "
                               "--ctx tokens."),
    model: Optional[str] = engine_option("model"),
    ctx: int = typer.Option(defaults.PERPLEXITY_CTX, "--ctx", "-c", metavar="N",
                            help="Tokens per window; the second half of each is scored "
                            "(llama-perplexity's -c)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", metavar="N", help="Score at most "
                                         "N windows (default: every whole window of FILE)."),
    batch: int = typer.Option(defaults.PERPLEXITY_BATCH, "--batch", "-b", metavar="N",
                              help="Positions per pass through the KV cache: up to "
                              f"{defaults.PERPLEXITY_BATCH} take the few-row kernels, "
                              "which --cpu-dot applies to; more are a prefill."),
    device: str = engine_option("device"),
    threads: int = engine_option("threads"),
    cpu_dot: Optional[str] = engine_option("cpu_dot"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the "
                                 "result line."),
) -> None:
    """The perplexity of FILE's text under a model, with its standard error: windows of
    --ctx tokens, the second half of each scored, as llama.cpp's llama-perplexity does."""
    _check(file, ctx, chunks, batch, device, threads, cpu_dot)
    if device != "cpu":
        require_torch(f"--device {device}")
    from .console import Progress

    terminate_gracefully()
    with Progress(0, not as_json) as progress:
        result = _measure(file, model, ctx, chunks, batch, device, threads, cpu_dot, progress)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(result_line(result))


def _check(file: str, ctx: int, chunks: Optional[int], batch: int, device: str,
           threads: int, cpu_dot: Optional[str]) -> None:
    """Every value that needs no model, before torch loads."""
    need(Path(file).is_file(), "FILE", file, "a text file")
    need(ctx >= defaults.PERPLEXITY_MIN_CTX, "--ctx", ctx,
         f"an integer >= {defaults.PERPLEXITY_MIN_CTX}")
    need(chunks is None or chunks >= 1, "--chunks", chunks, "an integer >= 1")
    need(1 <= batch <= ctx, "--batch", batch, f"an integer 1..{ctx} (--ctx)")
    check_device(device, "float32")
    check_threads(threads)
    check_cpu_dot(cpu_dot)


def _measure(file: str, model: Optional[str], ctx: int, chunks: Optional[int], batch: int,
             device: str, threads: int, cpu_dot: Optional[str], progress: Any
             ) -> Dict[str, Any]:
    """The figures of the run (``--json``'s object), ``progress`` shown meanwhile."""
    progress.phase("loading")
    spec = engine_spec(EngineOptions(model=model, device=device, nodes=1, threads=threads,
                                     cpu_dot=cpu_dot))
    from ..base.cpudot import cpu_dot as mode_in_force
    from ..tools.perplexity import Measurement, open_model

    text = open_text_model(spec)
    progress.phase("tokenizing")
    measurement = Measurement(text, Path(file), ctx, chunks)
    mode = mode_in_force()
    progress.phase("loading weights")
    net = open_model(text, device, threads)
    total, done, started = measurement.positions, 0, time.perf_counter()

    def ran(positions: int) -> None:
        nonlocal done
        done += positions
        progress.advance(done, done / max(time.perf_counter() - started, 1e-9), "scoring",
                         total)

    progress.advance(0, 0.0, "scoring", total)
    result = measurement.run(net, batch, ran)
    return dict(result, cpu_dot=mode, device=device, threads=compute_threads())


def result_line(result: Dict[str, Any]) -> str:
    """The one line a run prints: llama-perplexity's final estimate, then what it covered
    and how fast it ran."""
    return (f"PPL = {result['ppl']:.4f} +/- {result['ppl_stderr']:.5f} over "
            f"{plural(result['tokens'], 'token')} ({plural(result['windows'], 'window')} "
            f"of {result['ctx']}, "
            f"cpu-dot {result['cpu_dot']}; {result['seconds']:.1f} s, "
            f"{result['tokens_per_s']:.1f} tok/s)")
