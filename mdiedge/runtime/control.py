"""The HTTP control plane: every node serves small JSON requests (assign, connect, status,
reset, shutdown) with ``ControlServer``; ``ControlClient`` is the one client (the starter's,
and ``mdiedge status``'s).

Bodies are size-bounded and parsed as JSON only (nothing is unpickled or evaluated); a
handler's ``MdiedgeError`` becomes a 4xx answer with its one-line message.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from .auth import Authenticator
from .protocol import NodeStatus
from ..base.errors import MdiedgeError, RingError
from ..base.nodes import NodeSpec

log = logging.getLogger("mdiedge.control")

MAX_JSON_BODY = 1 << 20
PUBLIC_PATHS = frozenset({"/ping"})  # answers {"pong": true} and nothing else, for RTTs


def _ping(body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
    return {"pong": True}
Handler = Callable[[Dict[str, Any], bytes, Dict[str, str]], Dict[str, Any]]


class Conflict(MdiedgeError):
    """The node cannot take the request in its current state (HTTP 409)."""


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request: route, bounded body, signature, JSON, handler, JSON reply."""

    protocol_version = "HTTP/1.1"
    server: Any  # a ThreadingHTTPServer carrying ``control``, its ControlServer

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def _reply(self, code: int, payload: Dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _serve(self, method: str) -> None:
        control: "ControlServer" = self.server.control
        url = urlsplit(self.path)
        handler = control.routes.get((method, url.path))
        if handler is None:
            known = any(path == url.path for _, path in control.routes)
            self._reply(405 if known else 404, {"error": f"no route {method} {url.path}"})
            return
        raw = self._read_body(control, url.path)
        if raw is None:
            return
        refused = None if url.path in PUBLIC_PATHS else \
            control.auth.check(method, self.path, raw, self.headers)
        if refused is not None:
            log.warning("refused %s %s from %s: %s", method, url.path, self.client_address[0],
                        refused)
            self._reply(401, {"error": refused})
            return
        body = self._json(raw) if url.path not in control.raw_routes else {}
        if body is not None:
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            self._dispatch(handler, body, raw, query, f"{method} {url.path}")

    def _read_body(self, control: "ControlServer", path: str) -> Optional[bytes]:
        """The body within its route's size limit, or None after answering 400/413."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._reply(400, {"error": "bad Content-Length"})
            return None
        limit = control.raw_routes[path]() if path in control.raw_routes else MAX_JSON_BODY
        if length < 0 or length > limit:
            self.close_connection = True
            self._reply(413, {"error": f"body of {length} bytes exceeds the limit of {limit}"})
            return None
        return self.rfile.read(length) if length else b""

    def _json(self, raw: bytes) -> Optional[Dict[str, Any]]:
        """The body as a JSON object ({} when empty), or None after answering 400."""
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            self._reply(400, {"error": f"body is not JSON: {e}"})
            return None
        if not isinstance(body, dict):
            self._reply(400, {"error": "body must be a JSON object"})
            return None
        return body

    def _dispatch(self, handler: Handler, body: Dict[str, Any], raw: bytes,
                  query: Dict[str, str], what: str) -> None:
        try:
            self._reply(200, handler(body, raw, query))
        except Conflict as e:
            self._reply(409, {"error": str(e)})
        except (MdiedgeError, KeyError, TypeError, ValueError) as e:
            message = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            self._reply(400, {"error": message})
        except Exception as e:  # a bug: answer, log, stay up
            log.exception("control handler %s failed", what)
            self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")


class ControlServer:
    """Routes ``(method, path)`` to handlers taking (json body, raw body, query) -> json reply.

    ``raw_routes`` name the paths whose body is bytes (weights) and their size limit."""

    def __init__(self, host: str, port: int, routes: Dict[Tuple[str, str], Handler],
                 raw_routes: Optional[Dict[str, Callable[[], int]]] = None,
                 auth: Optional[Authenticator] = None) -> None:
        self.routes = dict(routes)
        self.routes[("GET", "/ping")] = _ping
        self.raw_routes = raw_routes or {}
        self.auth = auth or Authenticator(None)
        self.httpd = ThreadingHTTPServer((host, port), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.control = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="control", daemon=True)

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        return f"http://{'[%s]' % host if ':' in str(host) else host}:{self.port}"

    def add_routes(self, routes: Dict[Tuple[str, str], Handler]) -> None:
        """More routes, before ``start``."""
        self.routes.update(routes)

    def start(self) -> "ControlServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def round_trip_ms(base_url: str, timeout: float = 2.0) -> Optional[float]:
    """Round-trip time of one unauthenticated ping to a node's control plane, or None."""
    import time

    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(base_url + "/ping", timeout=timeout) as response:
            response.read()
    except (urllib.error.URLError, OSError):
        return None
    return round((time.perf_counter() - t0) * 1e3, 3)


def call(base_url: str, method: str, path: str, body: Optional[Dict[str, Any]] = None,
         raw: Optional[bytes] = None, timeout: float = 30.0, node: str = "",
         auth: Optional[Authenticator] = None) -> Dict[str, Any]:
    """One signed control request; a failure is a RingError naming the node and the reason."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(base_url + path, data=data, method=method)
    if auth is not None:
        for name, value in auth.sign(method, path, data or b"").items():
            request.add_header(name, value)
    request.add_header("Content-Type", "application/octet-stream" if raw is not None
                       else "application/json")
    who = f"{node} ({base_url})" if node else base_url
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", e.reason)
        except ValueError:
            message = e.reason
        error = RingError(f"{who}: {method} {path} refused ({e.code}): {message}")
        error.status = e.code  # type: ignore[attr-defined]
        raise error from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RingError(f"{who} is unreachable: {reason}") from None


class ControlClient:
    """Signed requests to one node's control plane; JSON bodies carry ``session`` (a worker
    serves one starter session at a time)."""

    def __init__(self, node: NodeSpec, auth: Optional[Authenticator] = None,
                 session: str = "") -> None:
        self.node, self.auth, self.session = node, auth, session

    def call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
             raw: Optional[bytes] = None, timeout: float = 30.0) -> Dict[str, Any]:
        if body is not None and self.session:
            body = dict(body, session=self.session)
        return call(self.node.url, method, path, body, raw, timeout, self.node.name, self.auth)

    def status(self, role: str = "worker", timeout: float = 5.0) -> NodeStatus:
        """The node's status, or a ``down`` status saying why it did not answer."""
        try:
            status = NodeStatus.from_json(self.call("GET", "/status", timeout=timeout))
        except RingError as e:
            return NodeStatus.down(role, self.node.name, self.node.address, str(e))
        status.address = self.node.address
        return status
