"""The API under uvicorn, on a thread of its own: ``open_api`` builds the service and the
app for an engine and binds the port at once (so a port in use is an error before anything
says it is ready)."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

from ...base import defaults
from ...base.backoff import is_shortage
from ...base.memory import give_back_free_memory, one_malloc_arena
from ...base.defaults import API_HEAD_TIMEOUT_S, API_START_TIMEOUT_S, MAX_SECRET_BYTES
from ...base.errors import ConfigError
from ...base.ratelog import Throttled
from ...base.settings import check_private
from ...base.smallfiles import read_small_file
from .rules import ServeLimits

if TYPE_CHECKING:
    from ...engine.engine import Engine

log = logging.getLogger("mdiedge.api")

API_KEY_ENV = "MDIEDGE_API_KEY"
LISTEN_BACKLOG = 128  # also the most connections asyncio accepts in one go, before the cap
#                       on open connections (guarded_protocol) closes any of them


def read_api_key(path: Optional[str]) -> Optional[str]:
    """``path``'s first line, else ``$MDIEDGE_API_KEY``, else None; never from argv (visible in
    ``ps``). The file must be private, as the ring's secret file."""
    if path:
        file, shown = Path(path).expanduser(), f"--api-key-file {path}"
        try:
            check_private(file.stat(), shown, path)
            lines = read_small_file(file, MAX_SECRET_BYTES, shown, lambda info: check_private(
                info, shown, path)).decode("utf-8").splitlines()
            key = lines[0].strip() if lines else ""
        except OSError as e:
            raise ConfigError(f"{shown}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{shown}: not UTF-8 text") from None
        if not key:
            raise ConfigError(f"{shown}: the file is empty")
        if not key.isprintable():
            raise ConfigError(f"{shown}: the key is not printable text")
        return key
    return os.environ.get(API_KEY_ENV, "").strip() or None


def model_name(path: Path) -> str:
    """A cache snapshot's repo id (``.../models--Org--Name/snapshots/HASH``: ``Org/Name``), else the
    folder's name or the file's stem."""
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/")
    return path.stem if path.suffix == ".bin" else path.name


def listen(host: str, port: int) -> socket.socket:
    """Port 0: a free one; a one-line error otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def guarded_protocol(max_connections: int = defaults.MAX_API_CONNECTIONS) -> Any:
    """uvicorn's h11 protocol with a deadline on each request's head and a bound on open
    connections. A connection without a whole request head within ``API_HEAD_TIMEOUT_S`` of opening
    or of its last response is closed (uvicorn only times out idle kept-alive ones, so a silent or
    byte-a-time client would hold its socket for ever). At ``max_connections`` a new connection
    closes the one waiting longest for a head, else itself: idle connections cannot take every
    descriptor nor lock a genuine client out."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _awaiting: Any = None  # the cycle current when the wait for a head began
        _idle_since = 0.0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_head()
            if not _make_room(self, self.connections, max_connections):
                transport.abort()

        def on_response_complete(self) -> None:
            self._await_head()  # first: a pipelined request starts its cycle in there
            super().on_response_complete()

        def _await_head(self) -> None:  # a new request makes a new cycle
            self._awaiting, self._idle_since = self.cycle, self.loop.time()
            self.loop.call_later(API_HEAD_TIMEOUT_S, self._head_due, self.cycle)

        def _head_due(self, cycle: Any) -> None:
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

        @property
        def idle(self) -> bool:
            """Waiting for a request's head, not serving one."""
            return self.cycle is self._awaiting and not self.transport.is_closing()

    return GuardedH11Protocol


def _make_room(new: Any, connections: Any, limit: int) -> bool:
    """Under ``limit``, or once the longest-idle other connection is closed."""
    open_ = [c for c in connections if not c.transport.is_closing()]
    if len(open_) <= limit:
        return True
    idle = [c for c in open_ if c is not new and c.idle]
    if not idle:
        _refused("API connection from %s closed: %d connections open, none idle",
                 _peer(new), len(open_) - 1)
        return False
    oldest = min(idle, key=lambda c: c._idle_since)
    oldest.transport.abort()
    _refused("API connection from %s closed to make room (%d connections open)",
             _peer(oldest), limit)
    return True


def _peer(protocol: Any) -> str:
    return str(protocol.client[0]) if protocol.client else "?"


_refused = Throttled(log, logging.WARNING, "API connections closed at the limit")
_shortage = Throttled(log, logging.WARNING, "API port: failed accepts")
_loop_faults = Throttled(log, logging.WARNING, "API port: connection errors")
UVICORN_LOG = "uvicorn.error"  # the logger uvicorn's protocols write a peer's faults to


class PeerLines(logging.Filter):
    """On uvicorn's error logger: lines about a peer's bytes ("Invalid HTTP request received.", an
    unsupported upgrade), which any client can repeat, go through a rate-limited summary."""

    def __init__(self) -> None:
        super().__init__()
        self.throttled = Throttled(logging.getLogger(UVICORN_LOG), logging.WARNING,
                                   "API port: refused requests")

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}protocols{os.sep}" not in record.pathname:
            return True  # uvicorn's own start and stop, and this filter's summaries
        return self.throttled.admit("%s", record.getMessage())


def throttle_peer_lines() -> None:
    """Once per process."""
    logger = logging.getLogger(UVICORN_LOG)
    if not any(isinstance(f, PeerLines) for f in logger.filters):
        logger.addFilter(PeerLines())


def _loop_errors(loop: Any, context: Dict[str, Any]) -> None:
    """The event loop's error handler: an accept out of descriptors or memory (retried each second)
    and a transport failing (a peer can provoke it) become rate-limited lines, not tracebacks."""
    error = context.get("exception")
    if is_shortage(error) and "accept" in str(context.get("message", "")):
        _shortage("API port: cannot accept a connection (%s); retrying", error)
        return
    if _loop_faults.admit("%s: %s", context.get("message"), error):
        loop.default_exception_handler(context)


def _server_class(activity: Callable[[], Tuple[int, int]]) -> Any:
    """uvicorn's server with ``_loop_errors``, at most ``API_THREADS`` handler threads, and memory
    given back when idle (``activity``: answered so far, running now)."""
    import anyio.to_thread
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            loop.set_exception_handler(_loop_errors)
            anyio.to_thread.current_default_thread_limiter().total_tokens = \
                defaults.API_THREADS
            self.trimmer = loop.create_task(trim_when_idle(activity))
            await super().startup(sockets=sockets)

    return Server


async def trim_when_idle(activity: Callable[[], Tuple[int, int]]) -> None:
    """Every ``API_TRIM_S``, when requests were answered since and none runs, give the heap's free
    memory back (a burst's buffers)."""
    last = -1
    if not give_back_free_memory():
        log.debug("no malloc_trim in this C library: a burst's memory stays resident")
        return
    while True:
        await asyncio.sleep(defaults.API_TRIM_S)
        answered, running = activity()
        if answered != last and running == 0:
            last = answered
            await asyncio.get_running_loop().run_in_executor(None, give_back_free_memory)


class ApiServer:
    """uvicorn serving ``app`` on ``sock`` from a thread; in a process with logging set up
    (``mdiedge starter``) uvicorn's loggers use its handlers."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str = "warning",
                 activity: Callable[[], Tuple[int, int]] = lambda: (0, 1)) -> None:
        import uvicorn
        from uvicorn.config import LOGGING_CONFIG

        self.sock = sock
        self.host, self.port = sock.getsockname()[:2]
        log_config = None if logging.getLogger().handlers else LOGGING_CONFIG
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False,
                                timeout_graceful_shutdown=3, http=guarded_protocol(),
                                backlog=LISTEN_BACKLOG,
                                log_config=log_config)
        throttle_peer_lines()  # after the config: uvicorn sets its loggers up in there
        one_malloc_arena()  # as `python -m mdiedge` does, for a server started in-process
        self.server = _server_class(activity)(config)
        self.thread = threading.Thread(target=self._serve, name="mdiedge-api", daemon=True)
        self.error: Optional[BaseException] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # reported by start() or seen as a stopped server
            self.error = e

    def start(self) -> "ApiServer":
        self.thread.start()
        deadline = time.monotonic() + API_START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the API server on {self.url} did not start: {self.error}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(10)
        self.sock.close()


class Api:

    def __init__(self, engine: "Engine", sock: socket.socket, limits: ServeLimits,
                 api_key: Optional[str] = None, name: Optional[str] = None,
                 log_level: str = "warning", strict_model_name: bool = False,
                 cors_origins: Sequence[str] = ()) -> None:
        from .app import build_app
        from .service import ApiService

        self.service = ApiService(engine, name or model_name(engine.path), limits,
                                  strict_model_name)
        self.server = ApiServer(build_app(self.service, api_key, cors_origins), sock,
                                log_level, self.service.activity)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> "Api":
        self.server.start()
        return self

    def close(self) -> None:
        self.service.close()
        self.server.stop()
