"""``mdiedge calibrate-exit``."""
from __future__ import annotations

import json
from typing import List, Optional

import typer

from ..base.torchcheck import require_torch
from .app import app, need, one_line_errors


@app.command("calibrate-exit")
@one_line_errors
def calibrate_exit(
    text: Optional[str] = typer.Option(None, help="Text file; its last --held-out share is "
                                       "held out (the first half of that calibrates). Default: "
                                       "Tiny Shakespeare's held-out tenth, shipped with NanoLlama."),
    model: Optional[str] = typer.Option(None, help="Model directory (default: the shipped "
                                        "NanoLlama); the files are written into it."),
    criterion: Optional[List[str]] = typer.Option(None, "--criterion", help="Calibrate this "
                                                  "one (repeat; default: all three)."),
    target: float = typer.Option(0.95, help="Top-1 agreement with the full model to reach."),
    held_out: Optional[float] = typer.Option(None, help="Share of the text at its end held "
                                             "out (default: 0.1 of --text, all of the shipped "
                                             "text)."),
    tokens: int = typer.Option(8192, help="Held-out tokens read (half calibrate)."),
    train_tokens: int = typer.Option(16384, help="Tokens before the held-out part that train "
                                     "the exit classifier."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Choose early-exit thresholds per criterion (and train the exit classifier) that reach
    --target top-1 agreement with the full model; write them beside the model."""
    from pathlib import Path

    from ..base.defaults import EARLY_EXIT_CRITERIA as CRITERIA

    chosen = list(dict.fromkeys(criterion or CRITERIA))
    for c in chosen:
        need(c in CRITERIA, "--criterion", c, "one of " + ", ".join(CRITERIA))
    need(0.0 < target <= 1.0, "--target", target, "a share in (0, 1]")
    need(held_out is None or 0.0 < held_out < 1.0, "--held-out", held_out, "a share in (0, 1)")
    need(tokens >= 64, "--tokens", tokens, "an integer >= 64")
    need(train_tokens >= 64, "--train-tokens", train_tokens, "an integer >= 64")
    need(text is None or Path(text).is_file(), "--text", text, "a text file")
    from ..base.defaults import held_out_text
    require_torch("mdiedge calibrate-exit")
    from ..tools.earlyexit.calibrate import run

    path, share = held_out_text(text)
    result = run(model, path, chosen, target, share if held_out is None else held_out, tokens,
                 train_tokens=train_tokens)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"{result['file']}: target {100 * target:.1f}% over {result['tokens']} tokens")
    for name, found in result["criteria"].items():
        typer.echo(f"{name:>10}: agreement {100 * found['top1_agreement']:.2f}%, "
                   f"{found['mean_layers']:.2f} blocks per token")
