"""``mdiedge bench``."""
from __future__ import annotations

import json
from typing import Any, Optional

import typer

from ..base.cpudot import set_cpu_dot
from ..base.engineoptions import check_cpu_dot
from ..base.torchcheck import require_torch
from .app import app, engine_option, need, one_line_errors


COMPRESSION_OPTION = typer.Option(
    None, metavar="CODEC", help="Instead, the quality guard of this link codec (as "
    "generate's --compression) against none on a ring of --nodes: bytes per hop, top-1 "
    "agreement and perplexity (teacher-forced over --text's held-out tail), time to first "
    "token and tokens/s.")
SPECULATE_OPTION = typer.Option(
    None, "--speculate", metavar="DRAFTER", help="Instead, greedy decoding plain and "
    "speculating with DRAFTER (ngram, ngram:N, draft:PATH; as generate's --speculate) "
    "side by side, in alternating runs (--repeat rounds), in one process and on a local "
    "ring of --nodes: a prompt that quotes a passage of --text and asks for it again "
    "(an instruct model's chat template), and free generation; decode tokens/s both "
    "ways, the ratio, acceptance, tokens per ring pass, and whether the texts are equal.")


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
    repeat: int = typer.Option(1, help="Runs of each configuration, each followed by its own "
                               "bandwidth probe: the row is the run with the median decode "
                               "tokens/s, beside the slowest and fastest (every run's figures "
                               "under \"runs\" in --json). For a machine whose speed varies."),
    compression: Optional[str] = COMPRESSION_OPTION,
    text: Optional[str] = typer.Option(None, help="Text file for --compression and "
                                       "--early-exit (its last 10% is the held-out text) and "
                                       "--speculate (its passages). Default: Tiny "
                                       "Shakespeare's held-out tenth, shipped with NanoLlama."),
    eval_tokens: int = typer.Option(4096, help="Held-out tokens scored with --compression."),
    early_exit: Optional[str] = typer.Option(
        None, "--early-exit", metavar="CRITERION", help="Instead, the same workload with and "
        "without early exit (softmax, similarity or classifier) on 1 and --nodes nodes, 1 and "
        "--samples samples: the throughput ratio, and top-1 agreement and perplexity "
        "teacher-forced over --text's held-out tail."),
    exit_threshold: Optional[str] = engine_option("exit_threshold"),
    profile: bool = typer.Option(False, "--profile", help="Instead, where a decode step's time "
                                 "goes on each node of a ring of --nodes (projections, "
                                 "attention, norms, RoPE, sampling, other), for 1 and "
                                 "--samples rows per step."),
    speculate: Optional[str] = SPECULATE_OPTION,
    cpu_dot: Optional[str] = engine_option("cpu_dot"),
) -> None:
    """Measure tokens/s (with the bandwidth limit and the share reached), busy fraction,
    per-hop overhead and peak RSS of 1..N-node rings."""
    from pathlib import Path

    repeat = _check_bench(nodes, samples, new_tokens, repeat, cpu_dot)
    require_torch("mdiedge bench")
    from ..tools import bench as benchmarks

    if isinstance(speculate, str) and speculate != "off":  # not the typer default
        _speculation(model, preset, speculate, text, nodes, samples, new_tokens, repeat, as_json)
        return
    if isinstance(early_exit, str) or isinstance(exit_threshold, str):  # not typer defaults
        _exits(model, early_exit, exit_threshold, text, nodes, samples, new_tokens, as_json)
        return
    if profile is True:  # not the typer default (bench() called as a function)
        _profile(model, preset, nodes, samples, context, as_json)
        return
    if compression is not None:
        _guard(model, compression, text, eval_tokens, nodes, context, new_tokens, as_json)
        return
    if one:
        result = benchmarks.run_config(Path(model or ""), nodes, samples, new_tokens, context,
                                       micro_batch)
        typer.echo(json.dumps(result))
        return
    _table(model, preset, nodes, samples, new_tokens, context, as_json, repeat)


def _check_bench(nodes: int, samples: int, new_tokens: int, repeat: Any,
                 cpu_dot: Any = None) -> int:
    """The values every kind of bench shares, checked before torch is loaded; the dot mode
    set (its runs take it from the environment). Returns ``repeat`` (1 for a typer default:
    bench() called as a function)."""
    repeat = repeat if isinstance(repeat, int) else 1
    cpu_dot = cpu_dot if isinstance(cpu_dot, str) else None
    need(nodes >= 1, "--nodes", nodes, "an integer >= 1")
    need(samples >= 1, "--samples", samples, "an integer >= 1")
    need(new_tokens >= 1, "--new-tokens", new_tokens, "an integer >= 1")
    need(1 <= repeat <= 100, "--repeat", repeat, "an integer 1..100")
    set_cpu_dot(check_cpu_dot(cpu_dot))
    return repeat


def _table(model: Optional[str], preset: Optional[str], nodes: int, samples: int,
           new_tokens: int, context: int, as_json: bool, repeat: int) -> None:
    from ..tools import bench as benchmarks
    from ..tools.benchtable import TableWriter, measuring_on_stderr

    title = (f"{preset or model or 'nanollama'}: {samples} samples x {new_tokens} tokens, "
             f"context {context}" + (f", median of {repeat} runs" if repeat > 1 else ""))
    measured = benchmarks.run_all(model, preset, nodes, samples, new_tokens, context,
                                  measuring=measuring_on_stderr, repeat=repeat)
    if as_json:
        typer.echo(json.dumps({"title": title, "results": list(measured)}))
        return
    table = TableWriter(title, nodes, repeat=repeat)
    table.header()
    results = []
    for result in measured:  # each row as soon as its configuration is measured
        table.row(result)
        results.append(result)
    table.footer(results)


def _profile(model: Optional[str], preset: Optional[str], nodes: int, samples: int,
             context: int, as_json: bool) -> None:
    import tempfile
    from pathlib import Path

    from .app import need
    from ..tools import bench as benchmarks
    from ..tools.profile import profile_ring, table_lines
    from ..model.checkpoint import resolve_model_path

    need(1 <= samples <= 8, "--samples", samples, "an integer 1..8 (rows of a decode step)")
    need(nodes >= 1, "--nodes", nodes, "an integer >= 1")
    need(context >= 16, "--context", context, "an integer >= 16")
    with tempfile.TemporaryDirectory(prefix="mdiedge-profile-") as tmp:
        path = (benchmarks.random_checkpoint(preset, Path(tmp) / preset,
                                             resolve_model_path(None) / "tokenizer.model")
                if preset else resolve_model_path(model))
        profiles = [p for rows in sorted({1, samples})
                    for p in profile_ring(path, nodes, rows, context)]
    if as_json:
        typer.echo(json.dumps({"model": preset or str(path), "nodes": nodes,
                               "profiles": profiles}))
        return
    typer.echo(f"{preset or path.name}: ms per decode step on each node of {nodes}, by category")
    for line in table_lines(profiles):
        typer.echo(line)


def _guard(model: Optional[str], compression: str, text: Optional[str], eval_tokens: int,
           nodes: int, context: int, new_tokens: int, as_json: bool) -> None:
    from pathlib import Path

    from ..base.engineoptions import canonical_compression

    compression = canonical_compression(compression)
    need(text is None or Path(text).is_file(), "--text", text,
         "a text file (its last 10% is the held-out text)")
    need(nodes >= 2, "--nodes", nodes, "an integer >= 2 (links need a ring)")
    from ..base.defaults import held_out_text
    from ..tools.quality import guard

    path, share = held_out_text(text)
    result = guard(model, compression, path, share, eval_tokens=eval_tokens,
                   prompt_tokens=max(1, context - new_tokens), new_tokens=new_tokens,
                   nodes=nodes)
    if as_json:
        typer.echo(json.dumps(result))
        return
    q, hop, runs = result["quality"], result["bytes_per_hop"], result["runs"]
    typer.echo(f"{result['model']}: {compression} against none, {nodes} nodes "
               f"(blocks {result['splits']})")
    typer.echo(f"bytes per hop: prefill of {result['prompt_tokens']} tokens "
               f"{hop['prefill'][0]} -> {hop['prefill'][1]} ({hop['prefill_reduction']}x), "
               f"decode {hop['decode'][0]} -> {hop['decode'][1]} ({hop['decode_reduction']}x)")
    typer.echo(f"top-1 agreement {100 * q['top1_agreement']:.2f}% over {q['tokens']} held-out "
               f"tokens; perplexity {q['perplexity_none']} -> {q['perplexity']} "
               f"({100 * q['perplexity_change']:+.2f}%)")
    for name, run in runs.items():
        typer.echo(f"{name}: time to first token {run['ttft_s']:.3f} s, decode "
                   f"{run['decode_tok_s']} tok/s, first link {run['links'][0]['bytes']} bytes")


def _exits(model: Optional[str], criterion: Any, threshold: Any,
           text: Optional[str], nodes: int, samples: int, new_tokens: int,
           as_json: bool) -> None:
    from pathlib import Path

    criterion = criterion if isinstance(criterion, str) else None  # bench() called directly
    threshold = threshold if isinstance(threshold, str) else None

    from ..base.engineoptions import check_early_exit

    check_early_exit(criterion, threshold)
    need(text is None or Path(text).is_file(), "--text", text,
         "a text file (its last 10% is the held-out text)")
    need(nodes >= 1, "--nodes", nodes, "an integer >= 1")
    need(samples >= 1, "--samples", samples, "an integer >= 1")
    from ..tools.earlyexit.bench import run

    def shown(row: dict) -> None:
        if not as_json:
            e = row["early_exit"] or {}
            typer.echo(f"{row['nodes']} node(s), {row['samples']} sample(s): "
                       f"{row['tokens_per_s_none']:.1f} -> {row['tokens_per_s_exit']:.1f} tok/s "
                       f"({row['speedup']:.2f}x), {e.get('mean_layers', 0):.2f} blocks per "
                       f"token, KV fill {e.get('kv_fill_s', 0):.3f} s")

    if not as_json:
        typer.echo(f"early exit by {criterion}: {new_tokens} greedy tokens per sample",
                   err=True)
    from ..base.defaults import held_out_text

    path, share = held_out_text(text)
    result = run(model, str(criterion), threshold, path, nodes, samples,
                 new_tokens=new_tokens, held_out=share, shown=shown)
    if as_json:
        typer.echo(json.dumps(result))
        return
    q = result["quality"]
    typer.echo(f"top-1 agreement {100 * q['top1_agreement']:.2f}% over {q['tokens']} held-out "
               f"tokens; perplexity {q['perplexity_none']} -> {q['perplexity']}; "
               f"{q['mean_layers']:.2f} blocks per token")


SPECULATION_COLUMNS = ("nodes", "workload", "plain tok/s", "spec tok/s", "ratio", "acceptance",
                       "tokens/pass", "same text")


def speculation_cells(row: dict) -> list:
    """A ``bench --speculate`` row's cells, in ``SPECULATION_COLUMNS`` order."""
    return [str(row["nodes"]), row["workload"], f"{row['plain_tokens_per_s']:.1f}",
            f"{row['spec_tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
            f"{100 * row['acceptance']:.0f}%", f"{row['tokens_per_pass']:.2f}",
            "yes" if row["same_text"] else "NO"]


def _speculation(model: Optional[str], preset: Any, speculate: str, text: Optional[str],
                 nodes: int, samples: int, new_tokens: int, rounds: int, as_json: bool) -> None:
    from pathlib import Path

    from ..base.defaults import held_out_text
    from ..engine.opening import EngineSpec, check_spec
    from ..model.checkpoint import resolve_model_path
    from ..tools import speculationbench
    from ..tools.benchtable import measuring_on_stderr

    check_spec(EngineSpec(speculate=speculate))
    need(not isinstance(preset, str), "--preset", preset, "none with --speculate (random "
         "weights repeat nothing: give --model)")
    need(text is None or Path(text).is_file(), "--text", text,
         "a text file (passages to quote come from it)")
    path = resolve_model_path(model)
    source = held_out_text(text)[0]
    render = _chat_render(path)
    title = (f"{path.name}: {speculate} against plain, greedy, {samples} sample"
             f"{'s' if samples > 1 else ''} x {new_tokens} tokens, "
             f"{rounds} round{'s' if rounds > 1 else ''} each way"
             + (", chat template" if render else ""))
    rows = speculationbench.run_all(path, speculate, nodes, samples, new_tokens, rounds, source,
                                    render, measuring=measuring_on_stderr)
    if as_json:
        typer.echo(json.dumps({"title": title, "speculate": speculate, "results": list(rows)}))
        return
    widths = [max(len(c), 8) for c in SPECULATION_COLUMNS]
    typer.echo(title)
    typer.echo("  ".join(c.rjust(w) for c, w in zip(SPECULATION_COLUMNS, widths)))
    for row in rows:
        typer.echo("  ".join(c.rjust(w) for c, w in zip(speculation_cells(row), widths)))


def _chat_render(path: Any) -> Any:
    """A user message as the model's own chat template renders it, or None when the model
    has none (a base model)."""
    from ..model.tokenizer import load_tokenizer
    from ..serving.api.chat import ChatTemplate
    from ..serving.api.schema import ChatMessage

    template = ChatTemplate.for_model(path, load_tokenizer(path))
    if template.is_default:
        return None
    return lambda user: str(template.render([ChatMessage("user", user)]))
