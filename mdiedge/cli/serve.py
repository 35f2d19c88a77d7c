"""``mdiedge serve``: the OpenAI-compatible API over a local ring (by default, with the shipped
model) or a ring file's workers; and the API options ``mdiedge starter`` shares."""
from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from ..engine.facade import Engine

from ..base import defaults
from .app import (app, check_device, check_early_exit, check_log_level, check_port,
                  device_option, dtype_option, model_option, tokenizer_option, engine_spec,
                  open_checked,
                  compression_option, early_exit_option, exit_threshold_option, need,
                  one_line_errors,
                  prefill_chunk_option, quantize_option, recover_option,
                  speculate_option, stall_timeout_option, ring_options, no_encrypt_option)



def check_api_options(slots: int, context: int, max_queue: int, max_body: int,
                      port: int = 0, log_level: str = "info") -> None:
    check_port("--port", port)
    check_log_level(log_level)
    need(1 <= slots <= 256, "--slots", slots, "an integer 1..256")
    need(context >= 0, "--context", context,
         f"an integer >= 0 (0: the model's, at most {defaults.API_CONTEXT})")
    need(0 <= max_queue <= defaults.MAX_QUEUE, "--max-queue", max_queue,
         f"an integer 0..{defaults.MAX_QUEUE}")
    need(1024 <= max_body <= 1 << 30, "--max-body", max_body, "a number of bytes 1024..2**30")


def api_key_for(host: str, key_file: Optional[str], insecure: bool) -> Optional[str]:
    """The API key (file, else $MDIEDGE_API_KEY); refuses a non-loopback address without one
    unless ``insecure``."""
    from ..base.errors import ConfigError
    from ..serving.api.server import API_KEY_ENV, read_api_key
    from ..runtime.auth import is_loopback

    key = read_api_key(key_file)
    if key is None and not is_loopback(host):
        if not insecure:
            raise ConfigError(f"refusing to serve the API on {host} without an API key (set "
                              f"--api-key-file or ${API_KEY_ENV}, or pass --insecure)")
        typer.echo(f"mdiedge: warning: the API on {host} takes requests from anyone who "
                   f"reaches it (--insecure, no API key)", err=True)
    return key


def open_api(engine: "Engine", sock: Any, slots: int, context: int, max_queue: int, max_body: int,
             key: Optional[str], name: Optional[str], log_level: str) -> Any:
    """The API of ``engine`` on the listening socket ``sock``: set up, not started."""
    from ..serving.api.rules import ServeLimits
    from ..serving.api.server import Api

    limits = ServeLimits(slots=slots, context=context, max_waiting=max_queue, max_body=max_body)
    return Api(engine, sock, limits, key, name, log_level)


def check_context(context: int, text_model: Any) -> None:
    """``--context`` within the model's, before any node starts."""
    from ..base.errors import UsageError

    top = text_model.cfg.max_seq_len
    if not 0 <= context <= top:
        raise UsageError(f"--context: expected 0..{top} tokens (the model's), got {context}")


def starter_api(engine: "Engine", port: Optional[int], host: str, key_file: Optional[str],
                insecure: bool, slots: int, log_level: str) -> Any:
    """``mdiedge starter --api-port``: the API of the starter's engine, bound, not started
    (None without a port)."""
    if port is None:
        return None
    check_port("--api-port", port)
    check_api_options(slots, 0, defaults.API_MAX_WAITING, defaults.API_MAX_BODY)
    key = api_key_for(host, key_file, insecure)
    from ..serving.api.server import listen

    return open_api(engine, listen(host, port), slots, 0, defaults.API_MAX_WAITING,
                    defaults.API_MAX_BODY, key, None, log_level)


@app.command()
@one_line_errors
def serve(
    host: str = typer.Option("127.0.0.1", help="Address of the API (another than loopback "
                             "needs an API key, or --insecure)."),
    port: int = typer.Option(defaults.API_PORT, help="Port of the API (0: any free port)."),
    model: Optional[str] = model_option(),
    tokenizer: Optional[str] = tokenizer_option(),
    model_name: Optional[str] = typer.Option(None, help="Model id of the API (default: the "
                                             "model folder's name)."),
    nodes: int = typer.Option(3, help="Nodes of the local ring started for the server (1: one "
                              "process, no ring)."),
    ring: Optional[str] = typer.Option(None, help="Ring file (TOML) of running workers."),
    device: str = device_option(),
    dtype: str = dtype_option(),
    slots: int = typer.Option(defaults.API_SLOTS, help="KV slots: samples decoded at once, shared by all "
                              "requests."),
    context: int = typer.Option(0, help="Tokens per slot, prompt plus completion (0: the "
                                f"model's context, at most {defaults.API_CONTEXT})."),
    max_queue: int = typer.Option(defaults.API_MAX_WAITING, help="Requests that may wait for free slots; "
                                  "more are refused with 429."),
    max_body: int = typer.Option(defaults.API_MAX_BODY, help="Largest request body in bytes (413 past it)."),
    api_key_file: Optional[str] = typer.Option(None, help="File holding the API key clients "
                                               "send as 'Authorization: Bearer KEY' (default: "
                                               "$MDIEDGE_API_KEY; none: no key)."),
    insecure: bool = typer.Option(False, help="Serve a non-loopback address without a key."),
    stall_timeout: Optional[float] = stall_timeout_option(),
    recover: Optional[bool] = recover_option(),
    prefill_chunk: Optional[int] = prefill_chunk_option(),
    spares: int = typer.Option(0, help="Spare workers started beside the local ring's."),
    log_level: str = typer.Option("warning", help="debug, info, warning or error."),
    compression: Optional[str] = compression_option(),
    quantize: Optional[str] = quantize_option(),
    no_encrypt: bool = no_encrypt_option(),
    early_exit: Optional[str] = early_exit_option(),
    exit_threshold: Optional[str] = exit_threshold_option(),
    speculate: str = speculate_option(),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /metrics)."""
    check_api_options(slots, context, max_queue, max_body, port, log_level)
    check_device(device, dtype)
    recovery = ring_options(stall_timeout, recover, spares, compression, prefill_chunk, quantize,
                            no_encrypt)
    exits = check_early_exit(early_exit, exit_threshold, speculate=speculate)
    key = api_key_for(host, api_key_file, insecure)
    from ..serving.api.server import listen

    with ExitStack() as stack:
        sock = listen(host, port)  # a port in use fails before any node starts
        stack.callback(sock.close)
        spec = engine_spec(model, tokenizer, device, dtype, nodes, ring, recovery, exits,
                           speculate, respawn=True)
        engine, _ = open_checked(stack, spec, lambda text: check_context(context, text))
        api = open_api(engine, sock, slots, context, max_queue, max_body, key, model_name,
                       log_level)
        stack.callback(api.close)
        engine.set_up()  # set the ring up now: its errors before "ready"
        api.start()
        _say_ready(api, slots)
        _wait_for_signal()


def _say_ready(api: Any, slots: int) -> None:
    """The one JSON line a supervisor waits for: where the API listens, and its shape."""
    typer.echo(json.dumps({"event": "ready", "url": api.url + "/v1", "model": api.service.name,
                           "slots": slots, "context": api.service.context,
                           "pid": os.getpid()}))
    sys.stdout.flush()


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    import signal
    import threading

    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    while not stopped.wait(defaults.STOP_POLL_S):  # a timed wait lets signal handlers run
        pass
