"""``mdiedge serve``: the OpenAI-compatible API over a local ring (by default, with the shipped
model) or a ring file's workers; and the API options ``mdiedge starter`` shares."""
from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack, closing
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import typer

if TYPE_CHECKING:
    from ..engine.engine import Engine

from ..base import defaults
from ..serving.api.cors import parse_origins
from ..base.engineoptions import EngineOptions
from .app import (app, check_log_level, check_port, engine_spec, need, one_line_errors,
                  open_checked, with_engine_options)


def check_api_options(slots: Optional[int], context: Optional[int], max_queue: int,
                      max_body: int, port: int = 0, log_level: str = "info") -> None:
    """The API's options in range (a slot count or context of None: sized from memory)."""
    check_port("--port", port)
    check_log_level(log_level)
    need(slots is None or 1 <= slots <= 256, "--slots", slots, "an integer 1..256")
    need(context is None or context >= 0, "--context", context,
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
             key: Optional[str], name: Optional[str], log_level: str,
             strict_model_name: bool = False, cors_origins: Sequence[str] = (),
             prompt_cache: bool = True) -> Any:
    """The API of ``engine`` on the listening socket ``sock``: set up, not started."""
    from ..serving.api.rules import ServeLimits
    from ..serving.api.server import Api

    engine.prompt_cache = prompt_cache
    limits = ServeLimits(slots=slots, context=context, max_waiting=max_queue, max_body=max_body)
    return Api(engine, sock, limits, key, name, log_level, strict_model_name, cors_origins)


def check_context(context: Optional[int], text_model: Any) -> None:
    """``--context`` within the model's, before any node starts."""
    from ..base.errors import UsageError

    top = text_model.cfg.max_seq_len
    if context is not None and not 0 <= context <= top:
        raise UsageError(f"--context: expected 0..{top} tokens (the model's), got {context}")


def sized_slots(text_model: Any, slots: Optional[int], context: Optional[int],
                opts: EngineOptions) -> Any:
    """The ``SlotShape`` of ``serve``: ``--slots`` and ``--context`` as given, what is not
    sized from the memory free for the KV cache (``slot_shape``), said on stderr."""
    from ..model.checks import free_bytes
    from ..serving.api.rules import KvModel, slot_shape

    check_context(context, text_model)
    cfg = text_model.cfg
    model = KvModel(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_itemsize(opts),
                    cfg.max_seq_len)
    if opts.ring is None:  # every node on this machine
        blocks, where = cfg.n_layers, (f"for the {cfg.n_layers} blocks on this machine" +
                                       (f" ({opts.nodes} nodes)" if opts.nodes > 1 else ""))
    else:
        from ..base.ringfile import load_ring

        held = 1 + sum(1 for w in load_ring(opts.ring)[1] if not w.spare)
        blocks = -(-cfg.n_layers // held)
        where = f"per node of {blocks} blocks (sized on this machine, the starter)"
    free, _ = free_bytes(opts.device)
    shape = slot_shape(model, free, blocks, slots, context)
    typer.echo("mdiedge: " + shape_line(shape, where), err=True)
    return shape


def kv_itemsize(opts: EngineOptions) -> int:
    """Bytes of a cached key or value: a torch-free CPU node's (``cpumodel.kv_dtype``: float16
    in the q8 mode), else the torch model's compute dtype."""
    from ..base.cpudot import dot_code
    from ..base.dtypes import compute_dtype
    from ..model.cpumodel import kv_dtype

    if opts.needs_torch() is None:
        return kv_dtype(dot_code()).itemsize
    return compute_dtype(opts.dtype).itemsize


def shape_line(shape: Any, where: str) -> str:
    """``serve``'s line on its slots and context: what it chose, and why (a ``SlotShape``
    of a KV cache held ``where``)."""
    from ..base.humanize import plural
    from ..placement.partition import format_bytes

    line = (f"serve: {plural(shape.slots, 'slot')} x {shape.context} tokens, KV cache "
            f"{format_bytes(shape.kv_bytes)} {where}")
    if shape.available is None:
        return line + "; available memory unknown: the most (--slots, --context to choose)"
    used = shape.kv_bytes / max(1, shape.available)
    percent = f"{used:.0%}" if used == 0 or used >= 0.005 else "<1%"
    line += f", {percent} of {format_bytes(shape.available)} available"
    if shape.chosen == "given":
        return line + " (--slots, --context)"
    if used > shape.share:
        return line + f": over {shape.share:.0%}, the least it sizes to"
    if shape.kv_bytes < shape.largest:
        return line + (f": sized to {shape.share:.0%} of it ({shape.most[0]} x "
                       f"{shape.most[1]} would take {format_bytes(shape.largest)})")
    return line + f": within {shape.share:.0%} of it"


def starter_api(engine: "Engine", port: Optional[int], host: str, key_file: Optional[str],
                insecure: bool, slots: int, log_level: str,
                naming: Tuple[bool, Sequence[str], bool] = (False, (), True)) -> Any:
    """``mdiedge starter --api-port``: the API of the starter's engine, bound, not started
    (None without a port); ``naming``: ``--strict-model-name``, the CORS origins and
    ``--prompt-cache`` as ``serve`` takes them."""
    if port is None:
        return None
    check_port("--api-port", port)
    check_api_options(slots, 0, defaults.API_MAX_WAITING, defaults.API_MAX_BODY)
    key = api_key_for(host, key_file, insecure)
    from ..serving.api.server import listen

    return open_api(engine, listen(host, port), slots, 0, defaults.API_MAX_WAITING,
                    defaults.API_MAX_BODY, key, None, log_level, *naming)


def api_key_file_option() -> Any:
    return typer.Option(None, help="File holding the API key clients send as 'Authorization: "
                        "Bearer KEY' or 'X-Api-Key: KEY' (default: $MDIEDGE_API_KEY; none: "
                        "no key).")


def strict_model_name_option() -> Any:
    return typer.Option(False, help="Answer a request naming another model with 404 "
                        "(default: the one model is served under any name).")


def cors_origins_option() -> Any:
    return typer.Option(None, help="Origins browsers may call the API from: a comma list "
                        "(https://app.example.com) or '*' (default: none).")


@app.command()
@one_line_errors
@with_engine_options("the server", helps={"spares": "Spare workers started beside the local "
                                          "ring's."})
def serve(
    host: str = typer.Option("127.0.0.1", help="Address of the API (another than loopback "
                             "needs an API key, or --insecure)."),
    port: int = typer.Option(defaults.API_PORT, help="Port of the API (0: any free port)."),
    model_name: Optional[str] = typer.Option(None, help="Model id (default: the model's name)."),
    strict_model_name: bool = strict_model_name_option(),
    cors_origins: Optional[str] = cors_origins_option(),
    slots: Optional[int] = typer.Option(None, help="KV slots: samples decoded at once (default: "
                                        f"up to {defaults.API_SLOTS}, as memory allows)."),
    context: Optional[int] = typer.Option(None, help="Tokens per slot, prompt plus completion "
                                          f"(default: the model's, at most "
                                          f"{defaults.API_CONTEXT}, as memory allows; 0: that)."),
    max_queue: int = typer.Option(defaults.API_MAX_WAITING, help="Requests that may wait for free slots; "
                                  "more are refused with 429."),
    max_body: int = typer.Option(defaults.API_MAX_BODY, help="Largest request body in bytes (413 past it)."),
    api_key_file: Optional[str] = api_key_file_option(),
    insecure: bool = typer.Option(False, help="Serve a non-loopback address without a key."),
    log_level: str = typer.Option("warning", help="debug, info, warning or error."),
    opts: EngineOptions = EngineOptions(),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /metrics)."""
    check_api_options(slots, context, max_queue, max_body, port, log_level)
    key, origins = api_key_for(host, api_key_file, insecure), parse_origins(cors_origins)
    from ..serving.api.server import listen

    with ExitStack() as stack:
        sock = stack.enter_context(closing(listen(host, port)))  # in use: fails before any node
        spec = engine_spec(opts, respawn=True)
        engine, shape = open_checked(stack, spec, lambda text: sized_slots(text, slots, context,
                                                                            opts))
        api = open_api(engine, sock, shape.slots, shape.context, max_queue, max_body, key,
                       model_name, log_level, strict_model_name, origins, opts.prompt_cache)
        stack.callback(api.close)
        engine.set_up()  # set the ring up now: its errors before "ready"
        api.start()
        _say_ready(api, shape.slots)
        _wait_for_signal()


def _say_ready(api: Any, slots: int) -> None:
    """The one JSON line a supervisor waits for: where the API listens, and its shape."""
    typer.echo(json.dumps({"event": "ready", "url": api.url + "/v1", "model": api.service.name,
                           "slots": slots, "context": api.service.context,
                           "pid": os.getpid()}))
    sys.stdout.flush()


def _wait_for_signal() -> None:
    import signal
    import threading

    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    while not stopped.wait(defaults.STOP_POLL_S):  # a timed wait lets signal handlers run
        pass
