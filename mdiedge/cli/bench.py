"""``mdiedge bench``."""
from __future__ import annotations

import json
from typing import Optional

import typer

from .app import app, one_line_errors


@app.command()
@one_line_errors
def bench(
    model: Optional[str] = typer.Option(None, help="Model to run (default: the shipped NanoLlama)."),
    preset: Optional[str] = typer.Option(None, help="Instead, random weights of a preset shape, "
                                         "e.g. nanollama-304m."),
    nodes: int = typer.Option(3, help="Largest ring to measure (1..nodes)."),
    samples: int = typer.Option(3, help="Samples generated together."),
    new_tokens: int = typer.Option(128, help="New tokens per sample."),
    context: int = typer.Option(256, help="Context per sample (prompt = context - new tokens)."),
    micro_batch: int = typer.Option(1, hidden=True),
    one: bool = typer.Option(False, "--one", hidden=True, help="Run one configuration here."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Measure tokens/s, busy fraction, per-hop overhead and peak RSS of 1..N-node rings."""
    from pathlib import Path

    from ..ops import bench as benchmarks

    if one:
        result = benchmarks.run_config(Path(model or ""), nodes, samples, new_tokens, context,
                                       micro_batch)
        typer.echo(json.dumps(result))
        return
    from ..ops.benchtable import TableWriter, measuring_on_stderr

    title = (f"{preset or model or 'nanollama'}: {samples} samples x {new_tokens} tokens, "
             f"context {context}")
    measured = benchmarks.run_all(model, preset, nodes, samples, new_tokens, context,
                                  measuring=measuring_on_stderr)
    if as_json:
        typer.echo(json.dumps({"title": title, "results": list(measured)}))
        return
    table = TableWriter(title, nodes)
    table.header()
    results = []
    for result in measured:  # each row as soon as its configuration is measured
        table.row(result)
        results.append(result)
    table.footer(results)
