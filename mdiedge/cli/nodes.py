"""``mdiedge worker`` and ``mdiedge starter``: the long-lived nodes."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, Optional, Tuple

import typer

from ..base import defaults
from ..base.cpudot import set_cpu_dot
from ..serving.api.cors import parse_origins
from ..base.engineoptions import EngineOptions, check_cpu_dot, check_threads, seconds_ok
from .app import (
    app,
    check_log_level,
    check_port,
    engine_option,
    need,
    one_line_errors,
    serve_under_systemd,
    warn_unsealed,
    with_engine_options,
)
from .serve import api_key_file_option, cors_origins_option, strict_model_name_option


def secret_fd_option() -> Any:
    """``--secret-fd`` of the worker and the starter."""
    return typer.Option(-1, help="Read the ring secret from this inherited file descriptor "
                        "(a pipe of a local ring; 0: the secret file the systemd units open "
                        "as standard input), not the config or env.")


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
    threads: int = engine_option("threads"),
    cpu_dot: Optional[str] = engine_option("cpu_dot"),
    name: str = typer.Option("worker", help="Name shown in logs and status."),
    cache_dir: Optional[str] = typer.Option(None, help="Where received weights are cached."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    parent_pid: int = typer.Option(0, help="Exit when this process is gone (local rings)."),
    insecure: bool = typer.Option(False, help="Allow a non-loopback address without a secret."),
    idle_timeout: float = typer.Option(defaults.IDLE_TIMEOUT_S, help="Seconds of starter silence before the "
                                       "worker frees its slots and returns to idle."),
    busy_poll_us: int = typer.Option(defaults.BUSY_POLL_US, help="Microseconds a wait for the "
                                     "next activation polls before it sleeps (0: sleep at "
                                     "once, the least power)."),
    no_encrypt: bool = engine_option("no_encrypt"),
    secret_fd: int = secret_fd_option(),
) -> None:
    """Run a worker node: it waits for a starter to assign it layers."""
    import logging

    from ..base.settings import WorkerSettings, find_config, load_settings

    need(parent_pid >= 0, "--parent-pid", parent_pid, "a process id >= 0")
    section = WorkerSettings()
    path = None if no_config else find_config(config)
    if path is not None:
        section = load_settings(path).worker or section
    # a flag given on the command line wins over the file, the file over the flag's default
    flags = {"host": host, "control_port": control_port, "data_port": data_port,
             "threads": threads, "name": name, "cache_dir": cache_dir, "log_level": log_level,
             "insecure": insecure, "idle_timeout_s": idle_timeout, "busy_poll_us": busy_poll_us,
             "encrypt": not no_encrypt, "cpu_dot": cpu_dot}
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
        check_port("--" + key.replace("_", "-"), flags[key])
    check_threads(flags["threads"])
    check_cpu_dot(flags["cpu_dot"])
    check_log_level(flags["log_level"])
    need(seconds_ok(flags["idle_timeout_s"]), "--idle-timeout", flags["idle_timeout_s"],
          "a number of seconds > 0")
    need(0 <= flags["busy_poll_us"] <= defaults.MAX_BUSY_POLL_US, "--busy-poll-us",
         flags["busy_poll_us"], f"an integer 0..{defaults.MAX_BUSY_POLL_US}")


def _secret_from_fd(fd: int) -> bytes:
    """The secret written to inherited descriptor ``fd`` (read to its end, then closed; a
    standard stream is left open on /dev/null): the secret stays out of the environment and
    the command line."""
    from ..base.defaults import MAX_SECRET_BYTES
    from ..base.errors import ConfigError, UsageError
    from ..base.smallfiles import check_secret

    try:
        with os.fdopen(fd, "rb") as pipe:
            secret = pipe.read(MAX_SECRET_BYTES + 3).rstrip(b"\r\n")  # + CR LF, + 1
    except OSError as e:
        raise UsageError(f"--secret-fd {fd}: cannot read the secret: {e.strerror or e}") from None
    if fd <= 2:
        _reopen_devnull(fd)
    try:
        return check_secret(secret, f"--secret-fd {fd}")
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _reopen_devnull(fd: int) -> None:
    """Put /dev/null on standard stream ``fd``, so that no socket opened later takes it."""
    null = os.open(os.devnull, os.O_RDWR)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _run_worker(chosen: Dict[str, Any], section: Any, parent_pid: int,
                secret: Optional[bytes]) -> None:
    """Start the worker node of the ``chosen`` settings and serve until it is stopped."""
    import signal
    from pathlib import Path

    from ..base.engineoptions import torch_option
    from ..base.settings import read_secret
    from ..base.threads import available_cores, node_threads, use_threads
    from ..base.torchcheck import require_torch

    needs = torch_option(section.device, section.dtype) if section.model is not None else None
    if needs is not None:
        require_torch(f"the worker's preload ({needs[2:]})")
    from ..serving.sdnotify import Heartbeat
    from ..roles.worker import WorkerNode

    use_threads(node_threads(chosen["threads"], 1, available_cores()))
    set_cpu_dot(chosen["cpu_dot"])
    heartbeat = Heartbeat(stall_limit=defaults.COMPUTE_STALL_S)
    node = WorkerNode(chosen["host"], chosen["control_port"], chosen["data_port"],
                      Path(chosen["cache_dir"]) if chosen["cache_dir"] else None,
                      name=chosen["name"],
                      secret=secret if secret is not None else read_secret(section),
                      insecure=chosen["insecure"], idle_timeout_s=chosen["idle_timeout_s"],
                      busy_poll_us=chosen["busy_poll_us"], encrypt=chosen["encrypt"],
                      heartbeat=heartbeat)
    if not chosen["encrypt"]:
        warn_unsealed(chosen["name"])
    if section.model is not None:
        node.preload(section.model, section.layers, section.device, section.dtype)
    node.start()
    # a local ring's worker (parent_pid) leaves Ctrl-C to its parent, which stops it
    for signum in (signal.SIGTERM,) if parent_pid else (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: node.stopped.set())
    if parent_pid:
        _stop_with_parent(parent_pid, node.stopped)
    typer.echo(json.dumps({"event": "ready", "name": chosen["name"],
                           "control_port": node.control.port, "data_port": node.data_port,
                           "pid": os.getpid()}))
    sys.stdout.flush()
    serve_under_systemd(node.stopped, f"{chosen['name']} listening on "
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

    param = {"idle_timeout_s": "idle_timeout", "encrypt": "no_encrypt"}.get(name, name)
    return ctx.get_parameter_source(param) == ParameterSource.COMMANDLINE


@app.command("starter")
@one_line_errors
@with_engine_options("", skip=("device", "dtype", "nodes", "ring", "stall_timeout", "recover",
                               "prefill_chunk", "spares", "speculate", "threads"),
                     helps={"model": "Model (default: the config's, else the shipped NanoLlama).",
                            "tokenizer": "Tokenizer file, if not the model's own."})
def starter_command(
    config: Optional[str] = typer.Option(None, help="Starter config (TOML): [starter] and "
                                         "[[workers]]; default $MDIEDGE_CONFIG, then "
                                         "/etc/mdiedge/mdiedge.toml."),
    control_port: Optional[int] = typer.Option(None, help="Port of this starter's control "
                                               "plane (default: the config's, else 7600)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    insecure: bool = typer.Option(False, help="Allow a non-loopback address without a secret."),
    api_port: Optional[int] = typer.Option(None, help="Also serve the OpenAI API on this port "
                                           "(as `mdiedge serve`; default: no API)."),
    api_host: str = typer.Option("127.0.0.1", help="Address of the API."),
    api_key_file: Optional[str] = api_key_file_option(),
    slots: int = typer.Option(defaults.API_SLOTS, help="KV slots the API's requests share."),
    strict_model_name: bool = strict_model_name_option(),
    cors_origins: Optional[str] = cors_origins_option(),
    secret_fd: int = secret_fd_option(),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", metavar="N", help="Compute "
                                          "threads (default: the config's, else 0: every core "
                                          "this process may use)."),
    opts: EngineOptions = EngineOptions(),
) -> None:
    """Run the starter as a long-lived process that owns the ring (and, with --api-port,
    the OpenAI API)."""
    import logging

    if control_port is not None:
        check_port("--control-port", control_port)
    check_log_level(log_level)
    naming = _api_naming(api_port, strict_model_name, cors_origins, opts.prompt_cache)
    settings, section = _starter_config(config, threads, opts.cpu_dot)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s starter %(levelname)s %(message)s")
    secret = _starter_secret(section, insecure, secret_fd)
    _starter_torch(section, opts)
    from ..serving.service import StarterServer
    from ..runtime.auth import Authenticator
    from ..runtime.control import ControlServer
    from .serve import starter_api

    port = section.control_port if control_port is None else control_port
    control = ControlServer(section.host, port, {}, auth=Authenticator(secret))
    if opts.no_encrypt or not section.encrypt:
        warn_unsealed("starter")
    engine = _starter_engine(settings, section, opts, secret, control.url)
    api = starter_api(engine, api_port, api_host, api_key_file, insecure, slots, log_level,
                      naming)
    _serve_starter(StarterServer(engine, control).start(), api, section.host)


def _api_naming(api_port: Optional[int], strict_model_name: bool, cors_origins: Optional[str],
                prompt_cache: bool) -> Tuple[bool, Any, bool]:
    """The API's flags, checked before anything starts: they need ``--api-port``."""
    for flag, value in (("--strict-model-name", strict_model_name or None),
                        ("--cors-origins", cors_origins)):
        need(api_port is not None or value is None, flag, value, "given with --api-port")
    return strict_model_name, parse_origins(cors_origins), prompt_cache


def _serve_starter(server: Any, api: Any, host: str) -> None:
    """Print the ready line, then serve until SIGTERM or SIGINT; close the API and server."""
    import signal
    import threading

    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    ready = {"event": "ready", "control_port": server.control.port, "pid": os.getpid()}
    if api is not None:
        ready["api_url"] = api.start().url + "/v1"
    typer.echo(json.dumps(ready))
    sys.stdout.flush()
    try:
        serve_under_systemd(stopped, f"starter listening on {host}:{server.control.port}")
    finally:
        if api is not None:
            api.close()
        server.close()


def _starter_secret(section: Any, insecure: bool, secret_fd: int) -> Optional[bytes]:
    """The ring secret (``--secret-fd``'s, else the config's or env's); refuses a non-loopback
    address without one unless ``insecure``."""
    from ..base.errors import ConfigError
    from ..base.settings import read_secret
    from ..runtime.auth import is_loopback

    secret = _secret_from_fd(secret_fd) if secret_fd >= 0 else read_secret(section)
    if secret is None and not (insecure or section.insecure) and not is_loopback(section.host):
        raise ConfigError(f"refusing to listen on {section.host} without a ring secret "
                          f"(set one, or pass --insecure on a trusted network)")
    return secret


def _starter_torch(section: Any, opts: EngineOptions) -> None:
    """torch loaded where the starter's dtype or options need it (a one-line error where it
    is not installed)."""
    from ..base.engineoptions import torch_option
    from ..base.torchcheck import require_torch

    needs = torch_option("cpu", section.dtype, opts.early_exit)
    if needs is not None:
        require_torch(needs)


def _starter_engine(settings: Any, section: Any, opts: EngineOptions,
                    secret: Optional[bytes], control_url: str) -> Any:
    """The starter's ``RingEngine`` over the config's workers (nothing set up yet): the
    config's ``[starter]`` options, the command line's (``opts``) winning where given."""
    from ..base.nodes import StarterOptions
    from ..base.ringfile import starter_options
    from ..engine.opening import EngineSpec, open_engine

    options = StarterOptions(**starter_options(section), dtype=section.dtype, secret=secret,
                             control_url=control_url, name=starter_name(control_url))
    return open_engine(EngineSpec(**dict(
        vars(opts), model=opts.model or section.model,
        tokenizer=opts.tokenizer or section.tokenizer, threads=section.threads),
        workers=settings.workers, options=options))


def starter_name(control_url: str) -> str:
    """The long-lived starter's name: this machine and its control address, the same after
    a restart (so it takes its workers back at once), another for any other starter."""
    import socket

    return f"{socket.gethostname()} {control_url}"


def _starter_config(config: Optional[str], threads: Optional[int] = None,
                    cpu_dot: Optional[str] = None) -> Any:
    """The starter's settings file (it must name the workers) and its ``[starter]`` table,
    with ``--threads`` and ``--cpu-dot`` where given; the dot mode set for this process."""
    from ..base.errors import ConfigError, UsageError
    from ..base.settings import StarterSettings, find_config, load_settings

    if threads is not None:
        check_threads(threads)
    check_cpu_dot(cpu_dot)
    path = find_config(config)
    if path is None:
        raise UsageError("no config: pass --config FILE with [starter] and [[workers]]")
    settings = load_settings(path)
    if not settings.workers:
        raise ConfigError(f"{path}: workers: a starter needs at least one [[workers]] entry")
    section = settings.starter or StarterSettings()
    given = {key: value for key, value in (("threads", threads), ("cpu_dot", cpu_dot))
             if value is not None}
    section = dataclasses.replace(section, **given)
    set_cpu_dot(section.cpu_dot)
    return settings, section
