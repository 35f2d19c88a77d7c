"""The ``mdiedge`` command line: thin typer commands; errors become one line and an exit code.

torch is imported only inside commands, so ``mdiedge --help`` answers fast.
"""
from __future__ import annotations

import functools
import json
import os
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
    micro_batch: int = typer.Option(0, help="Samples per message / forward pass (0: chosen "
                                    "to keep every node busy)."),
    nodes: int = typer.Option(3, help="Nodes of the local ring started for this run (1: one "
                              "process, no ring)."),
    ring: Optional[str] = typer.Option(None, help="Ring file (TOML) of running workers."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Generate text from PROMPT, on a ring of nodes (by default a local ring of 3)."""
    from contextlib import ExitStack

    from .sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with ExitStack() as stack:
        _terminate_gracefully()
        engine = _open_engine(stack, model, tokenizer, device, dtype, nodes, ring,
                              lambda e: e.new_generation(prompt, max_new_tokens, samples, params, None))
        _generate_with(engine, prompt, max_new_tokens, samples, params, micro_batch, as_json,
                       nodes if ring is None else len(engine.workers) + 1)


def _terminate_gracefully() -> None:
    """SIGTERM unwinds like Ctrl-C, so every process a command started is stopped."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _open_engine(stack: Any, model: Optional[str], tokenizer: Optional[str], device: str,
                 dtype: str, nodes: int, ring: Optional[str], check: Callable[[Any], Any]) -> Any:
    """The engine for ``--nodes``/``--ring``; ``check`` validates the request before any node
    process is started."""
    if ring is not None:
        from pathlib import Path

        from .ringfile import load_ring
        from .starter import RingEngine

        options, workers = load_ring(Path(ring))
        device = options.pop("device", device)
        engine = RingEngine(workers, model, tokenizer, device=device, dtype=dtype, **options)
        stack.callback(engine.close)
        check(engine)
        return engine
    if nodes < 1:
        raise typer.BadParameter(f"--nodes must be >= 1, got {nodes}")
    if nodes == 1:
        from .engine import LocalEngine

        local = LocalEngine(model, tokenizer, device=device, dtype=dtype)
        check(local)
        return local
    import torch

    from .local import LocalRing, threads_per_node
    from .starter import RingEngine

    threads = threads_per_node(nodes)
    torch.set_num_threads(threads)
    local_ring = LocalRing(nodes - 1, threads=threads)
    engine = RingEngine([], model, tokenizer, device=device, dtype=dtype, secret=local_ring.secret)
    check(engine)
    stack.callback(engine.close)
    engine.workers = stack.enter_context(local_ring)
    return engine


def _generate_with(engine: Any, prompt: str, max_new_tokens: int, samples: int, params: Any,
                   micro_batch: int, as_json: bool, n_nodes: int) -> None:
    import time

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
        result["nodes"] = n_nodes
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


@app.command()
@one_line_errors
def worker(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (control and data)."),
    control_port: int = typer.Option(7700, help="HTTP control port (0: any free port)."),
    data_port: int = typer.Option(7701, help="Data-plane port (0: any free port)."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    name: str = typer.Option("worker", help="Name shown in logs and status."),
    cache_dir: Optional[str] = typer.Option(None, help="Where received weights are cached."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    parent_pid: int = typer.Option(0, help="Exit when this process is gone (local rings)."),
    insecure: bool = typer.Option(False, help="Allow a non-loopback address without a secret."),
    idle_timeout: float = typer.Option(60.0, help="Seconds of starter silence before the "
                                       "worker frees its slots and returns to idle."),
) -> None:
    """Run a worker node: it waits for a starter to assign it layers."""
    import logging
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    import torch

    from .worker import WorkerNode

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    if threads > 0:
        torch.set_num_threads(threads)
    node = WorkerNode(host, control_port, data_port, Path(cache_dir) if cache_dir else None,
                      name=name, secret=_env_secret(), insecure=insecure,
                      idle_timeout_s=idle_timeout).start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: node.stopped.set())
    if parent_pid:
        def watch_parent() -> None:
            while not node.stopped.is_set():
                if os.getppid() != parent_pid:
                    node.stopped.set()
                time.sleep(0.5)

        threading.Thread(target=watch_parent, daemon=True).start()
    typer.echo(json.dumps({"event": "ready", "name": name, "control_port": node.control.port,
                           "data_port": node.data_port, "pid": os.getpid()}))
    sys.stdout.flush()
    _serve_under_systemd(node.stopped, f"{name} listening on {host}:{node.control.port}")
    node.close()


def _env_secret() -> Optional[bytes]:
    value = os.environ.get("MDIEDGE_SECRET")
    return value.encode() if value else None


def _serve_under_systemd(stopped: Any, status: str) -> None:
    """READY=1 now (the node listens and holds what it was configured to load), WATCHDOG=1
    pings while it runs, STOPPING=1 once a stop is requested; returns then."""
    from .sdnotify import Watchdog, notify, watchdog_interval

    notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
    interval = watchdog_interval()
    if interval is not None:
        Watchdog(interval, stopped).start()
    while not stopped.wait(0.5):  # a timed wait lets signal handlers run
        pass
    notify("STOPPING=1")


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

    from . import bench as benchmarks

    if one:
        result = benchmarks.run_config(Path(model or ""), nodes, samples, new_tokens, context,
                                       micro_batch)
        typer.echo(json.dumps(result))
        return
    results = benchmarks.run_all(model, preset, nodes, samples, new_tokens, context)
    title = (f"{preset or model or 'nanollama'}: {samples} samples x {new_tokens} tokens, "
             f"context {context}")
    if as_json:
        typer.echo(json.dumps({"title": title, "results": results}))
    else:
        benchmarks.print_table(results, title)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
