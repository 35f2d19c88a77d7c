"""The root typer app and what every command shares: one-line errors, value checks, the
client's signature and the systemd service loop."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import typer

from ..base import defaults, interrupts
from ..base.cpudot import set_cpu_dot
from ..base.engineoptions import EngineOptions
from ..base.errors import GenerationError, MdiedgeError, UsageError, need
from ..base.request import Asked, SamplingParams, named
from ..base.torchcheck import require_torch, torch_missing
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
    """A Ctrl-C while loading was held back (``__main__``) and is acted on once the command starts,
    or here when none ran. typer ends a Ctrl-C during parsing with status 130 and no word: the line
    is printed here."""
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
    """mdiedge errors, Ctrl-C and OS errors as one stderr line and an exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            interrupts.release()
            return func(*args, **kwargs)
        except MdiedgeError as e:
            raise fail(str(e).replace("\n", " "), e.exit_code) from None
        except ImportError as e:  # torch, where a path that needs it did not ask first
            if (e.name or "").split(".")[0] != "torch":
                raise
            command = "mdiedge " + func.__name__.strip("_").replace("_", "-")
            raise fail(str(torch_missing(command))) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except OSError as e:
            raise fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
        except Exception as e:
            if not interrupted_by(e):
                raise
            raise fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


def interrupted_by(error: BaseException) -> bool:
    """Whether a Ctrl-C (KeyboardInterrupt) is among ``error``'s causes: Python wraps one that
    lands in some hooks, such as a dataclass field's ``__set_name__`` while a module imports
    (a RuntimeError), instead of letting it through."""
    seen = set()
    found: Optional[BaseException] = error
    while found is not None and id(found) not in seen:
        if isinstance(found, KeyboardInterrupt):
            return True
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return False


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """A lower layer's check of command-line values (codec, device, budget) fails as a usage error:
    exit 2."""
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
    """Checked once, with no model and no torch; ``seed`` None: a drawn one. A bad value is a usage
    error naming its option."""
    try:
        params = SamplingParams(temperature, top_k, top_p,
                                defaults.random_seed() if seed is None else seed)
        return Asked(max_new_tokens, samples, params, tuple(stop))
    except GenerationError as e:
        raise UsageError(named(e, REQUEST_OPTIONS, REQUEST_NOTES)[1]) from None


def check_port(option: str, port: int) -> None:
    need(0 <= port <= 65535, option, port, "a port 0..65535")


def check_log_level(level: str) -> None:
    from ..base.settings import LOG_LEVELS

    need(level.lower() in LOG_LEVELS, "--log-level", level, "one of " + ", ".join(LOG_LEVELS))


def check_url(option: str, url: str) -> str:
    """An http(s) URL with a host (and a valid port), else a one-line error."""
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
    """Eager, so it answers before typer asks for a command."""
    if value:
        from .. import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                        is_eager=True, callback=_print_version)) -> None:
    pass



def serve_under_systemd(stopped: Any, status: str, heartbeat: Any = None) -> None:
    """READY=1 now, WATCHDOG=1 pings while running (a worker's only while its compute makes
    progress), STOPPING=1 once a stop is requested."""
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


def temperature_option() -> Any:
    return typer.Option(defaults.TEMPERATURE, help="0 is greedy.")


def top_k_option() -> Any:
    return typer.Option(defaults.TOP_K, help="Keep the k most likely tokens (0: off).")


def top_p_option() -> Any:
    return typer.Option(defaults.TOP_P, help="Nucleus sampling threshold (1: off).")


def warn_unsealed(name: str) -> None:
    import logging

    logging.getLogger("mdiedge").warning("%s: data links are not sealed (--no-encrypt): "
                                         "activations travel in plaintext; for measurements "
                                         "only", name)


def engine_spec(opts: EngineOptions, respawn: bool = False) -> Any:
    """Torch loaded first where an option needs it (one-line error if not installed); ``respawn``: a
    local ring's dead worker restarts. ``--cpu-dot`` is set for this process and its workers."""
    set_cpu_dot(opts.cpu_dot)
    needs = opts.needs_torch()
    if needs is not None:
        require_torch(needs)
    from ..engine.opening import EngineSpec

    return EngineSpec(**vars(opts), respawn=respawn)


def engine_option(name: str, started_for: str = "", help: Optional[str] = None) -> Any:
    """``help``: another text."""
    meta = _ENGINE_FIELDS[name].metadata
    return typer.Option(_ENGINE_FIELDS[name].default, *meta["names"], metavar=meta["metavar"],
                        help=(help or meta["help"]).format(started_for=started_for))


def with_engine_options(started_for: str, skip: Sequence[str] = (),
                        helps: Optional[Dict[str, str]] = None) -> Callable[[F], F]:
    """A command's ``opts: EngineOptions`` parameter as the record's typer options (but ``skip``;
    ``helps``: other texts); the command gets the record, checked."""
    import inspect
    from typing import get_type_hints

    names = [name for name in _ENGINE_FIELDS if name not in skip]
    hints = get_type_hints(EngineOptions)
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[name],
                               default=engine_option(name, started_for, (helps or {}).get(name)))
             for name in names]

    def wrap(command: F) -> F:
        own = get_type_hints(command)
        params = [q for p in inspect.signature(command).parameters.values()
                  for q in (added if p.name == "opts" else [p.replace(
                      kind=inspect.Parameter.KEYWORD_ONLY, annotation=own[p.name])])]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in names}
            return command(opts=EngineOptions(**given).checked(), **kwargs)

        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return wrap


_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineOptions) if "help" in f.metadata}


def open_text_model(spec: Any) -> Any:
    """Device and dtype checked as usage errors first; a command checks its request against it
    before any node starts."""
    from ..engine.opening import check_spec, open_text

    with usage_errors():
        check_spec(spec)
    return open_text(spec)


def open_checked(stack: Any, spec: Any, check: Callable[[Any], T]) -> Tuple[Any, T]:
    """The engine, closed with ``stack``, and what ``check`` returned on the text side before any
    node starts; the engine opens on that same text side."""
    from ..engine.opening import open_engine

    text = open_text_model(spec)
    checked = check(text)
    return stack.enter_context(open_engine(spec, text)), checked
