"""The ``mdiedge`` command line: thin typer commands; errors become one line and an exit code.

torch is imported only inside commands, so ``mdiedge --help`` answers fast.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable, Dict, Optional, TypeVar

import typer

from .base import defaults
from .base.errors import MdiedgeError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
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


def _need(ok: bool, option: str, value: Any, expected: str) -> None:
    """A command-line value out of range is one line naming the option and the value."""
    if not ok:
        raise fail(f"{option}: expected {expected}, got {value!r}", 2)


def _seconds(value: float) -> bool:
    import math

    return math.isfinite(value) and value > 0


def _check_port(option: str, port: int) -> None:
    _need(0 <= port <= 65535, option, port, "a port 0..65535")


def _check_log_level(level: str) -> None:
    from .base.settings import LOG_LEVELS

    _need(level.lower() in LOG_LEVELS, "--log-level", level, "one of " + ", ".join(LOG_LEVELS))


def _check_url(option: str, url: str) -> str:
    """``url`` if it is an http(s) URL with a host (and a valid port), else a one-line error."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        ok = False
    _need(ok, option, url, "an http:// URL such as http://10.0.0.1:7600")
    return url.rstrip("/")


def _print_version(value: bool) -> None:
    """``--version``: eager, so it answers before typer asks for a command."""
    if value:
        from . import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                        is_eager=True, callback=_print_version)) -> None:
    pass


@app.command()
@one_line_errors
def generate(
    prompt: str = typer.Argument(..., help="Text to continue ('' starts from BOS alone)."),
    max_new_tokens: int = typer.Option(defaults.MAX_NEW_TOKENS, "-n", "--max-new-tokens",
                                       help="Token budget per sample."),
    model: Optional[str] = typer.Option(None, help="HF model directory or llama2.c .bin file "
                                        "(default: the shipped NanoLlama)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer file, if not the model's own."),
    samples: int = typer.Option(1, help="Number of samples generated together."),
    seed: int = typer.Option(defaults.SEED, help="Random seed; sample i uses its own stream."),
    temperature: float = typer.Option(defaults.TEMPERATURE, help="0 is greedy."),
    top_k: int = typer.Option(defaults.TOP_K, help="Keep the k most likely tokens (0: off)."),
    top_p: float = typer.Option(defaults.TOP_P, help="Nucleus sampling threshold (1: off)."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    micro_batch: int = typer.Option(0, help="Samples per message / forward pass (0: chosen "
                                    "to keep every node busy)."),
    nodes: int = typer.Option(3, help="Nodes of the local ring started for this run (1: one "
                              "process, no ring)."),
    ring: Optional[str] = typer.Option(None, help="Ring file (TOML) of running workers."),
    starter: Optional[str] = typer.Option(None, help="URL of a running `mdiedge starter` to "
                                          "generate through."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    stall_timeout: Optional[float] = typer.Option(
        None, "--stall-timeout", metavar="SECONDS", help="A message not back around the ring "
        f"within this is a failure, and the node that froze is named (default: "
        f"{defaults.LOCAL_RING_TIMEOUT_S:g} for a local ring, the ring file's timeout_s)."),
) -> None:
    """Generate text from PROMPT, on a ring of nodes (by default a local ring of 3)."""
    from contextlib import ExitStack

    _need(micro_batch >= 0, "--micro-batch", micro_batch, "an integer >= 0")
    _need(stall_timeout is None or _seconds(stall_timeout), "--stall-timeout", stall_timeout,
          "a number of seconds > 0")
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    if starter:  # no torch here: the starter checks the values and samples
        _generate_through(_check_url("--starter", starter), prompt, max_new_tokens, samples,
                          sampling, micro_batch, as_json)
        return
    from .model.sampling import SamplingParams

    params = SamplingParams(**sampling)
    from .ops.console import Progress

    with ExitStack() as stack:
        _terminate_gracefully()
        progress = stack.enter_context(Progress(max_new_tokens * samples, not as_json,
                                                streaming=samples == 1 and not as_json))
        progress.phase("loading" if ring is None and nodes == 1 else
                       "connecting" if ring is not None else "starting nodes")
        engine = _open_engine(stack, model, tokenizer, device, dtype, nodes, ring, stall_timeout,
                              lambda e: e.new_generation(prompt, max_new_tokens, samples, params, None))
        _generate_with(engine, prompt, max_new_tokens, samples, params, micro_batch, as_json,
                       nodes if ring is None else len(engine.workers) + 1, progress)


def _generate_through(url: str, prompt: str, max_new_tokens: int, samples: int,
                      sampling: Dict[str, Any], micro_batch: int, as_json: bool) -> None:
    from .runtime.control import call

    body = dict(sampling, prompt=prompt, max_new_tokens=max_new_tokens, samples=samples,
                micro_batch=micro_batch)
    result = call(url, "POST", "/generate", body, timeout=3600, node="starter",
                  auth=_client_auth())
    if as_json:
        typer.echo(json.dumps(result))
        return
    for sample in result["samples"]:
        if len(result["samples"]) > 1:
            typer.echo(f"--- sample {sample['index']} ({sample['finish_reason']}) ---")
        typer.echo(prompt + sample["text"])
    t = result["timing"]
    typer.echo(f"[{t['new_tokens']} tokens in {t['total_s']:.2f} s, {t['tokens_per_s']:.1f} tok/s]",
               err=True)


def _terminate_gracefully() -> None:
    """SIGTERM unwinds like Ctrl-C, so every process a command started is stopped."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _open_engine(stack: Any, model: Optional[str], tokenizer: Optional[str], device: str,
                 dtype: str, nodes: int, ring: Optional[str], stall: Optional[float],
                 check: Callable[[Any], Any]) -> Any:
    """The engine for ``--nodes``/``--ring``; ``check`` validates the request (given the
    model's text side) before any node process is started; ``stall``: ``--stall-timeout``."""
    _need(ring is not None or nodes >= 1, "--nodes", nodes, "an integer >= 1")
    if ring is None and nodes == 1:
        from .roles.engine import LocalEngine

        local = LocalEngine(model, tokenizer, device=device, dtype=dtype)
        check(local)
        return local
    from .model.devices import parse_device, parse_dtype
    from .roles.engine import TextModel
    from .roles.starter import RingEngine

    parse_device(device), parse_dtype(dtype)  # errors before any node process starts
    check(TextModel(model, tokenizer))
    if ring is not None:
        from .base.ringfile import load_ring

        from .base.nodes import StarterOptions

        found, workers = load_ring(ring, secret=True)  # [starter] secret(_file), else the env
        if stall is not None:
            found["timeout_s"] = stall
        engine = RingEngine(workers, model, tokenizer, StarterOptions(**found), dtype=dtype)
    else:
        import torch

        from .roles.local_ring import LocalRing, threads_per_node

        threads = threads_per_node(nodes)
        torch.set_num_threads(threads)
        local_ring = LocalRing(nodes - 1, threads=threads, device=device)
        workers = stack.enter_context(local_ring)
        engine = RingEngine(workers, model, tokenizer, device=device, dtype=dtype,
                            secret=local_ring.secret,
                            timeout_s=stall or defaults.LOCAL_RING_TIMEOUT_S)
    stack.callback(engine.close)
    return engine


def _generate_with(engine: Any, prompt: str, max_new_tokens: int, samples: int, params: Any,
                   micro_batch: int, as_json: bool, n_nodes: int, progress: Any) -> None:
    """Generate on ``engine``; one sample streams to stdout, the prompt written with the first
    token (once ``progress`` has left the terminal to the text)."""
    import time

    stream = samples == 1 and not as_json
    decoder = None
    if stream:
        from .model.tokenizer import StreamDecoder

        decoder = StreamDecoder(engine.tokenizer, engine.encode_prompt(prompt))
    started = time.perf_counter()
    produced = 0

    def on_token(index: int, token: int) -> None:
        nonlocal produced
        produced += 1
        progress.advance(produced, produced / max(time.perf_counter() - started, 1e-9))
        if decoder is not None:
            sys.stdout.write((prompt if produced == 1 else "") + decoder.push(token))
            sys.stdout.flush()

    progress.phase("prefill")
    out = engine.generate(prompt, max_new_tokens, samples, params, micro_batch, on_token)
    progress.stop()
    if as_json:
        result = out.as_dict()
        result["model"] = str(engine.path)
        result["nodes"] = n_nodes
        typer.echo(json.dumps(result))
        return
    if stream:
        sys.stdout.write(("" if produced else prompt) + "\n")
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
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, help="Worker config (TOML, [worker] table); "
                                         "default $MDIEDGE_CONFIG, then /etc/mdiedge/mdiedge.toml."),
    no_config: bool = typer.Option(False, "--no-config", help="Read no config file."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (control and data)."),
    control_port: int = typer.Option(defaults.WORKER_CONTROL_PORT,
                                     help="HTTP control port (0: any free port)."),
    data_port: int = typer.Option(defaults.WORKER_DATA_PORT,
                                  help="Data-plane port (0: any free port)."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    name: str = typer.Option("worker", help="Name shown in logs and status."),
    cache_dir: Optional[str] = typer.Option(None, help="Where received weights are cached."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    parent_pid: int = typer.Option(0, help="Exit when this process is gone (local rings)."),
    insecure: bool = typer.Option(False, help="Allow a non-loopback address without a secret."),
    idle_timeout: float = typer.Option(defaults.IDLE_TIMEOUT_S, help="Seconds of starter silence before the "
                                       "worker frees its slots and returns to idle."),
    secret_fd: int = typer.Option(-1, help="Read the ring secret from this inherited file "
                                  "descriptor (a pipe; local rings), not the config or env."),
) -> None:
    """Run a worker node: it waits for a starter to assign it layers."""
    import logging

    from .base.settings import WorkerSettings, find_config, load_settings

    _need(parent_pid >= 0, "--parent-pid", parent_pid, "a process id >= 0")
    section = WorkerSettings()
    path = None if no_config else find_config(config)
    if path is not None:
        section = load_settings(path).worker or section
    # a flag given on the command line wins over the file, the file over the flag's default
    flags = {"host": host, "control_port": control_port, "data_port": data_port,
             "threads": threads, "name": name, "cache_dir": cache_dir, "log_level": log_level,
             "insecure": insecure, "idle_timeout_s": idle_timeout}
    _check_worker_flags(flags)
    chosen = {key: value if _from_command_line(ctx, key) or key not in section.keys_set
              else getattr(section, key) for key, value in flags.items()}
    logging.basicConfig(level=chosen["log_level"].upper(), stream=sys.stderr,
                        format=f"%(asctime)s {chosen['name']} %(levelname)s %(message)s")
    secret = _secret_from_fd(secret_fd) if secret_fd >= 0 else None
    _run_worker(chosen, section, parent_pid, secret)


def _check_worker_flags(flags: Dict[str, Any]) -> None:
    """The worker's command-line values (a config file's are checked by its schema)."""
    for key in ("control_port", "data_port"):
        _check_port("--" + key.replace("_", "-"), flags[key])
    _need(0 <= flags["threads"] <= defaults.MAX_THREADS, "--threads", flags["threads"],
          f"an integer 0..{defaults.MAX_THREADS}")
    _check_log_level(flags["log_level"])
    _need(_seconds(flags["idle_timeout_s"]), "--idle-timeout", flags["idle_timeout_s"],
          "a number of seconds > 0")


def _secret_from_fd(fd: int) -> bytes:
    """The secret written to inherited descriptor ``fd`` (read to its end, then closed): the
    secret stays out of the environment and the command line."""
    from .base.errors import ConfigError
    from .base.settings import MIN_SECRET_BYTES

    try:
        with os.fdopen(fd, "rb") as pipe:
            secret = pipe.read().rstrip(b"\n")
    except OSError as e:
        raise ConfigError(f"--secret-fd {fd}: cannot read the secret: {e.strerror or e}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"--secret-fd {fd}: expected a secret of at least {MIN_SECRET_BYTES} "
                          f"bytes, got {len(secret)} bytes")
    return secret


def _run_worker(chosen: Dict[str, Any], section: Any, parent_pid: int,
                secret: Optional[bytes]) -> None:
    """Start the worker node of the ``chosen`` settings and serve until it is stopped."""
    import signal
    from pathlib import Path

    import torch

    from .base.settings import read_secret
    from .ops.sdnotify import Heartbeat
    from .roles.worker import WorkerNode

    if chosen["threads"] > 0:
        torch.set_num_threads(chosen["threads"])
    heartbeat = Heartbeat(stall_limit=defaults.COMPUTE_STALL_S)
    node = WorkerNode(chosen["host"], chosen["control_port"], chosen["data_port"],
                      Path(chosen["cache_dir"]) if chosen["cache_dir"] else None,
                      name=chosen["name"],
                      secret=secret if secret is not None else read_secret(section),
                      insecure=chosen["insecure"], idle_timeout_s=chosen["idle_timeout_s"],
                      heartbeat=heartbeat)
    if section.model is not None:
        node.preload(section.model, section.layers, section.device, section.dtype)
    node.start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: node.stopped.set())
    if parent_pid:
        _stop_with_parent(parent_pid, node.stopped)
    typer.echo(json.dumps({"event": "ready", "name": chosen["name"],
                           "control_port": node.control.port, "data_port": node.data_port,
                           "pid": os.getpid()}))
    sys.stdout.flush()
    _serve_under_systemd(node.stopped, f"{chosen['name']} listening on "
                                       f"{chosen['host']}:{node.control.port}", heartbeat)
    node.close()


def _stop_with_parent(parent_pid: int, stopped: Any) -> None:
    """Set ``stopped`` once the process ``parent_pid`` is no longer our parent."""
    import threading
    import time

    def watch() -> None:
        while not stopped.is_set():
            if os.getppid() != parent_pid:
                stopped.set()
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent", daemon=True).start()


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    from click.core import ParameterSource

    param = {"idle_timeout_s": "idle_timeout"}.get(name, name)
    return ctx.get_parameter_source(param) == ParameterSource.COMMANDLINE


config_app = typer.Typer(help="Config files.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(config_app, name="config")


@config_app.command("check")
@one_line_errors
def config_check(file: str = typer.Argument(..., help="The TOML file to validate.")) -> None:
    """Validate a config file; one line naming the file and key on error."""
    from .base.settings import check_config

    typer.echo(check_config(file))


@config_app.command("init")
@one_line_errors
def config_init(kind: str = typer.Argument(..., help="worker, starter or ring.")) -> None:
    """Print a commented config skeleton of KIND: redirect it into a file and edit it."""
    from .ops.units import skeleton

    typer.echo(skeleton(kind), nl=False)


def _serve_under_systemd(stopped: Any, status: str, heartbeat: Any = None) -> None:
    """READY=1 now (the node listens and holds what it was configured to load), WATCHDOG=1
    pings while it runs (for a worker, only while its compute makes progress: see
    ``Heartbeat``), STOPPING=1 once a stop is requested; returns then."""
    from .ops.sdnotify import Watchdog, always_healthy, notify, watchdog_interval

    notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
    interval = watchdog_interval()
    if interval is not None:
        healthy = heartbeat.healthy if heartbeat is not None else always_healthy
        reason = heartbeat.reason if heartbeat is not None else None
        Watchdog(interval, stopped, healthy, reason).start()
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

    from .ops import bench as benchmarks

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


@app.command("starter")
@one_line_errors
def starter_command(
    config: Optional[str] = typer.Option(None, help="Starter config (TOML): [starter] and "
                                         "[[workers]]; default $MDIEDGE_CONFIG, then "
                                         "/etc/mdiedge/mdiedge.toml."),
    control_port: Optional[int] = typer.Option(None, help="Port of this starter's control "
                                               "plane (default: the config's, else 7600)."),
    model: Optional[str] = typer.Option(None, help="Model (default: the config's, else the "
                                        "shipped NanoLlama)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer file, if not the model's own."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    insecure: bool = typer.Option(False, help="Allow a non-loopback address without a secret."),
) -> None:
    """Run the starter as a long-lived process that owns the ring."""
    import logging
    import signal
    import threading

    if control_port is not None:
        _check_port("--control-port", control_port)
    _check_log_level(log_level)
    from .runtime.auth import is_loopback
    from .base.errors import ConfigError
    from .base.settings import read_secret

    settings, section = _starter_config(config)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s starter %(levelname)s %(message)s")
    secret = read_secret(section)
    if secret is None and not (insecure or section.insecure) and not is_loopback(section.host):
        raise ConfigError(f"refusing to listen on {section.host} without a ring secret "
                          f"(set one, or pass --insecure on a trusted network)")
    from .base.nodes import StarterOptions
    from .ops.serve import StarterServer
    from .roles.starter import RingEngine
    from .runtime.auth import Authenticator
    from .runtime.control import ControlServer

    port = section.control_port if control_port is None else control_port
    control = ControlServer(section.host, port, {}, auth=Authenticator(secret))
    options = StarterOptions(
        host=section.host, device=section.device, dtype=section.dtype, weight=section.weight,
        memory=section.memory, layers=section.layers,
        max_payload=section.max_payload or defaults.MAX_PAYLOAD, timeout_s=section.timeout_s,
        secret=secret, control_url=control.url)
    engine = RingEngine(settings.workers, model or section.model, tokenizer or section.tokenizer,
                        options)
    server = StarterServer(engine, control).start()
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    typer.echo(json.dumps({"event": "ready", "control_port": server.control.port,
                           "pid": os.getpid()}))
    sys.stdout.flush()
    try:
        _serve_under_systemd(stopped, f"starter listening on {section.host}:{server.control.port}")
    finally:
        server.close()


def _starter_config(config: Optional[str]) -> Any:
    """The starter's settings file (it must name the workers) and its ``[starter]`` table."""
    from .base.errors import ConfigError
    from .base.settings import StarterSettings, find_config, load_settings

    path = find_config(config)
    if path is None:
        raise ConfigError("no config: pass --config FILE with [starter] and [[workers]]")
    settings = load_settings(path)
    if not settings.workers:
        raise ConfigError(f"{path}: workers: a starter needs at least one [[workers]] entry")
    return settings, settings.starter or StarterSettings()


@app.command()
@one_line_errors
def status(
    ring: Optional[str] = typer.Option(None, help="Ring file (TOML) naming the workers."),
    starter: Optional[str] = typer.Option(None, help="URL of a running `mdiedge starter`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    wide: bool = typer.Option(False, "--wide", help="Show every column (default: those that "
                              "fit the terminal)."),
) -> None:
    """Show every node of the ring. Exit code 0 when every node answered, 69 when any node
    is down, 77 when none is down but a node refused the request as unsigned or wrongly
    signed (state "unauthorized": set MDIEDGE_SECRET or the ring file's secret)."""
    from .ops.console import print_status, refused, starter_nodes

    if starter:
        nodes = starter_nodes(_check_url("--starter", starter), starter, _client_auth())
    elif ring:
        from .base.ringfile import load_ring
        from .runtime.auth import Authenticator
        from .runtime.control import ControlClient

        found, workers = load_ring(ring, secret=True)
        auth = Authenticator(found["secret"])
        nodes = [ControlClient(w, auth).status().to_json() for w in workers]
    else:
        raise fail("pass --ring FILE or --starter URL", 2)
    nodes = [refused(node) for node in nodes]
    down = [n["name"] for n in nodes if n.get("state") == "down"]
    denied = [n["name"] for n in nodes if n.get("state") == "unauthorized"]
    if as_json:
        typer.echo(json.dumps({"nodes": nodes, "down": down, "unauthorized": denied}))
    else:
        print_status(nodes, wide)
    if down or denied:
        raise typer.Exit(69 if down else 77)


def _client_auth() -> Any:
    from .base.settings import read_secret
    from .runtime.auth import Authenticator

    return Authenticator(read_secret(None))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
