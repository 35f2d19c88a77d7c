"""``mdiedge generate``: one generation on a local ring, a ring file's workers or a running
starter; one sample streams to stdout."""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import typer

if TYPE_CHECKING:
    from ..base.request import Asked, Request
    from ..engine.engine import Engine, TextModel

from ..base import defaults
from ..base.engineoptions import EngineOptions
from .app import (
    app,
    asked,
    check_url,
    client_auth,
    engine_spec,
    need,
    one_line_errors,
    open_checked,
    temperature_option,
    terminate_gracefully,
    top_k_option,
    top_p_option,
    usage_errors,
    with_engine_options,
)
from .usage import ArgumentsCommand


@app.command(cls=ArgumentsCommand)
@one_line_errors
@with_engine_options("this run", skip=("prompt_cache",))
def generate(
    prompt: str = typer.Argument(..., metavar="PROMPT",
                                 help="Text to continue ('' starts from BOS alone)."),
    max_new_tokens: int = typer.Option(defaults.MAX_NEW_TOKENS, "-n", "--max-new-tokens",
                                       help="Token budget per sample."),
    samples: int = typer.Option(1, help="Number of samples generated together (on a "
                                "terminal each is printed as soon as it finishes)."),
    seed: Optional[int] = typer.Option(None, help="Random seed; sample i uses its own stream "
                                       "(default: a drawn one, shown by --json and after "
                                       "the text, so that --seed repeats the run)."),
    temperature: float = temperature_option(),
    top_k: int = top_k_option(),
    top_p: float = top_p_option(),
    micro_batch: int = typer.Option(0, help="Samples per message / forward pass (0: chosen "
                                    "to keep every node busy)."),
    starter: Optional[str] = typer.Option(None, help="URL of a running `mdiedge starter` to "
                                          "generate through."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", metavar="TEXT", help="End a "
                                             "sample at this text, not printed (repeatable)."),
    opts: "EngineOptions" = EngineOptions(),
) -> None:
    """Generate text from PROMPT, on a ring of nodes (by default a local ring: --nodes)."""
    wanted = asked(max_new_tokens, samples, temperature, top_k, top_p, seed, stop or ())
    need(micro_batch >= 0, "--micro-batch", micro_batch, "an integer >= 0")
    _check_starter(starter, opts)
    if starter:  # no torch here: the starter takes the request in
        return _generate_through(check_url("--starter", starter), prompt, wanted, micro_batch,
                                 as_json)
    with ExitStack() as stack:
        terminate_gracefully()
        progress = stack.enter_context(_progress(max_new_tokens * samples, samples, as_json))
        progress.phase(_first_phase(opts.ring, opts.nodes))
        spec = engine_spec(opts)
        engine, request = open_checked(stack, spec, lambda text: _taken_in(text, prompt, wanted))
        _generate_with(engine, request, micro_batch, as_json,
                       lambda: opts.nodes if opts.ring is None else engine.ring_nodes(),
                       progress, seed is None)


def _check_starter(starter: Optional[str], opts: EngineOptions) -> None:
    """A running starter generates as it was started: no ``--speculate`` nor ``--early-exit``."""
    need(starter is None or opts.speculate == "off", "--speculate", opts.speculate,
         "off with --starter (a running starter generates as it was started)")
    need(starter is None or opts.early_exit is None, "--early-exit", opts.early_exit,
         "no --starter (a running starter generates as it was started)")


def _taken_in(text: "TextModel", prompt: str, wanted: "Asked") -> "Request":
    """The request, taken in by the model of ``text`` (the prompt tokenized, once, and its
    budget fitting the model's context): a usage error before any node starts."""
    with usage_errors():
        return text.request(prompt, wanted)


def _progress(tokens: int, samples: int, as_json: bool) -> Any:
    """The spinner and bar of a generation of ``tokens`` new tokens on stderr."""
    from .console import Progress

    return Progress(tokens, not as_json, streaming=samples == 1 and not as_json)


def _first_phase(ring: Optional[str], nodes: int) -> str:
    return "loading" if ring is None and nodes == 1 else \
        "connecting" if ring is not None else "starting nodes"


def _generate_through(url: str, prompt: str, wanted: "Asked", micro_batch: int,
                      as_json: bool) -> None:
    from .console import timing_line
    from ..runtime.control import call

    params = wanted.params
    body = dict(prompt=prompt, max_new_tokens=wanted.max_new_tokens, samples=wanted.n_samples,
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                seed=params.seed, stop=list(wanted.stop), micro_batch=micro_batch)
    result = call(url, "POST", "/generate", body, timeout=3600, node="starter",
                  auth=client_auth())
    if as_json:
        typer.echo(json.dumps(result))
        return
    for sample in result["samples"]:
        if len(result["samples"]) > 1:
            typer.echo(f"--- sample {sample['index']} ({sample['finish_reason']}) ---")
        typer.echo(prompt + sample["text"])
    typer.echo(timing_line(result["timing"]), err=True)



class _Stream:
    """One sample's text on stdout as it is sampled, the prompt written with its first part
    (``TextOutput.fresh``: never a stop string, nor the start of one that may still form)."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt

    def write(self, text: str) -> None:
        from .console import write_text

        write_text(self.prompt + text)
        self.prompt = ""


class _Finished:
    """Several samples on a terminal: each is printed, labelled, as soon as it is seen
    finished (so in the order they finish); the ones left at the end in index order."""

    def __init__(self, prompt: str, progress: Any) -> None:
        self.prompt, self.progress = prompt, progress
        self.shown: set = set()

    def check(self, generation: Any) -> None:
        """After a token: print the samples that are done (their budget spent now, or an
        EOS or stop string met since the last token)."""
        for sample in generation.samples:
            full = len(sample.tokens) >= generation.max_new_tokens
            if sample.index not in self.shown and (sample.done or full):
                self.show(sample.index, sample.finish_reason or "length", sample.text)

    def show(self, index: int, reason: str, text: str) -> None:
        self.shown.add(index)
        self.progress.write(f"--- sample {index} ({reason}) ---\n{self.prompt}{text}\n")

    def rest(self, samples: List[Dict[str, Any]]) -> None:
        for sample in samples:
            if sample["index"] not in self.shown:
                self.show(sample["index"], sample["finish_reason"], sample["text"])


def _generate_with(engine: "Engine", request: "Request", micro_batch: int, as_json: bool,
                   n_nodes: Callable[[], int], progress: Any, drawn_seed: bool = False) -> None:
    """Generate ``request`` on ``engine``; one sample streams to stdout, the prompt written
    with the first token (once ``progress`` has left the terminal to the text); several are
    printed as they finish on a terminal, else at the end; ``drawn_seed``: the seed was not
    given, so the summary line names it."""
    import time

    from .console import timing_line

    prompt, samples, params = request.prompt.text, request.n_samples, request.params
    stream = _Stream(prompt) if samples == 1 and not as_json else None
    early = _Finished(prompt, progress) \
        if samples > 1 and not as_json and sys.stdout.isatty() else None
    started = time.perf_counter()
    produced = 0

    def on_token(index: int, token: int) -> None:
        nonlocal produced
        produced += 1
        progress.advance(produced, produced / max(time.perf_counter() - started, 1e-9))
        if stream is not None:
            stream.write(generation.samples[index].output.fresh())
        if early is not None:
            early.check(generation)

    progress.phase("prefill")
    generation = engine.generation_of(request, on_token)
    out = engine.output(request.prompt, generation, engine.run(generation, micro_batch))
    if early is not None:
        early.rest(out.samples)
    progress.stop()
    if as_json:
        result = out.as_dict()
        result["seed"] = params.seed
        result["model"] = str(engine.path)
        result["nodes"] = n_nodes()
        result["links"] = engine.link_stats()
        result["decode"] = [dict(node=n.name, layers=n.layers, **n.decode)
                            for n in engine.status()]
        typer.echo(json.dumps(result))
        return
    if stream is not None:
        stream.write(generation.samples[0].output.rest(out.samples[0]["text"]) + "\n")
    elif early is None:
        for sample in out.samples:
            typer.echo(f"--- sample {sample['index']} ({sample['finish_reason']}) ---")
            typer.echo(prompt + sample["text"])
    seed = f"seed {params.seed}" if drawn_seed and not params.greedy else ""
    typer.echo(timing_line(out.timing.as_dict(), seed), err=True)

