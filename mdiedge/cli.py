"""The ``mdiedge`` command line: thin typer commands; errors become one line and an exit code.

torch is imported only inside commands, so ``mdiedge --help`` answers fast.
"""
from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable, Optional, TypeVar

import typer

from .errors import MdiedgeError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Model-distributed inference of decoder-only LLMs across small devices.")

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 1) -> "typer.Exit":
    typer.echo(f"mdiedge: error: {message}", err=True)
    return typer.Exit(code)


def one_line_errors(func: F) -> F:
    """Turn mdiedge errors, Ctrl-C and OS errors into one stderr line and an exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MdiedgeError as e:
            raise fail(str(e).replace("\n", " "), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except OSError as e:
            raise fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None

    return wrapper  # type: ignore[return-value]


class _Progress:
    """A progress bar with tokens/s on stderr when it is a terminal, else a summary line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.bar = total, enabled and sys.stderr.isatty(), None
        self.task: Any = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self.bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                console=Console(file=sys.stderr), transient=True,
                                redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)
            self.bar.start()
            self.task = self.bar.add_task("generate", total=self.total, rate="")
        return self

    def advance(self, done: int, rate: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, rate=f"{rate:.1f} tok/s")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                        is_eager=True)) -> None:
    if version:
        from . import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.command()
@one_line_errors
def generate(
    prompt: str = typer.Argument(..., help="Text to continue ('' starts from BOS alone)."),
    max_new_tokens: int = typer.Option(256, "-n", "--max-new-tokens", help="Token budget per sample."),
    model: Optional[str] = typer.Option(None, help="HF model directory or llama2.c .bin file "
                                        "(default: the shipped NanoLlama)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer file, if not the model's own."),
    samples: int = typer.Option(1, help="Number of samples generated together."),
    seed: int = typer.Option(0, help="Random seed; sample i uses its own stream."),
    temperature: float = typer.Option(0.8, help="0 is greedy."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0: off)."),
    top_p: float = typer.Option(0.95, help="Nucleus sampling threshold (1: off)."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    dtype: str = typer.Option("float32", help="float32 (default), bfloat16 or float16."),
    micro_batch: int = typer.Option(0, help="Samples per forward pass (0: all active)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate text from PROMPT."""
    import time

    from .engine import LocalEngine
    from .sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    engine = LocalEngine(model, tokenizer, device=device, dtype=dtype)
    stream = samples == 1 and not as_json
    decoder = None
    if stream:
        from .tokenizer import StreamDecoder

        decoder = StreamDecoder(engine.tokenizer, engine.encode_prompt(prompt))
        sys.stdout.write(prompt)
        sys.stdout.flush()
    started = time.perf_counter()
    produced = 0
    with _Progress(max_new_tokens * samples, enabled=not as_json) as progress:

        def on_token(index: int, token: int) -> None:
            nonlocal produced
            produced += 1
            if decoder is not None:
                sys.stdout.write(decoder.push(token))
                sys.stdout.flush()
            progress.advance(produced, produced / max(time.perf_counter() - started, 1e-9))

        out = engine.generate(prompt, max_new_tokens, samples, params, micro_batch, on_token)
    if as_json:
        result = out.as_dict()
        result["model"] = str(engine.path)
        result["nodes"] = 1
        typer.echo(json.dumps(result))
        return
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        for sample in out.samples:
            typer.echo(f"--- sample {sample['index']} ({sample['finish_reason']}) ---")
            typer.echo(prompt + sample["text"])
    t = out.timing
    typer.echo(f"[{t.new_tokens} tokens in {t.total_s:.2f} s, {t.tokens_per_s:.1f} tok/s]", err=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
