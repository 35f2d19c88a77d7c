"""The HTTP control plane: ``ControlServer`` on every node and ``ControlClient``.

A request is authenticated from its headers before any body is read (the signature covers the body's
digest, checked once in), so an unauthenticated peer never makes the node read or allocate a body.
Replies are signed (``HEADER_REPLY``, bound to the request's nonce) and the client refuses one that
does not verify. Bodies are size-bounded, read in chunks, JSON only; connections bounded
(``_Slots``) and timed out; a reply leaving a body unread closes the connection, so nothing hidden
in it is served as a request."""
from __future__ import annotations

import hashlib
import http.client
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from .auth import HEADER_NONCE, HEADER_REPLY, NODE_CHANGED, Authenticator
from .protocol import NodeStatus
from ..base import defaults
from ..base.backoff import AcceptBackoff
from ..base.defaults import CONTROL_MIN_BODY_RATE, CONTROL_SOCKET_TIMEOUT_S, MAX_SKEW_S
from ..base.errors import Conflict, ListenError, MdiedgeError, RingError
from ..base.nodes import NodeSpec
from ..base.ratelog import Throttled

log = logging.getLogger("mdiedge.control")

MAX_JSON_BODY = 1 << 20
PUBLIC_PATHS = frozenset({"/ping"})  # {"pong": true, "node": its id}: RTTs, and what to sign for
MAX_CONNECTIONS = defaults.MAX_CONTROL_CONNECTIONS
_CHUNK = 1 << 20
_LENGTH = re.compile(r"[0-9]{1,19}")
_BUSY_BODY = b'{"error": "too many control connections"}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def body_deadline_s(length: int, timeout_s: float) -> float:
    """One socket timeout plus the body at ``CONTROL_MIN_BODY_RATE``: a body trickled within each
    read's timeout cannot hold its connection for ever."""
    return timeout_s + length / CONTROL_MIN_BODY_RATE


Handler = Callable[[Dict[str, Any], bytes, Dict[str, str]], Dict[str, Any]]


class _Handler(BaseHTTPRequestHandler):

    protocol_version = "HTTP/1.1"
    server: Any  # a _Server carrying ``control``, its ControlServer

    def setup(self) -> None:
        self.timeout = self.server.control.timeout_s
        super().setup()

    def handle_one_request(self) -> None:
        super().handle_one_request()
        if not self.close_connection:  # kept alive: evictable until the next one authenticates
            self.server.control.slots.waiting(self.connection)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), fmt % args)

    def _reply(self, code: int, payload: Dict[str, Any], close: bool = False) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        nonce = getattr(self, "signed_nonce", "")
        if nonce:  # the reply to an authenticated request: signed for it
            self.send_header(HEADER_REPLY, self.server.control.auth.sign_reply(code, nonce, body))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close or code >= 400:  # an error may leave a body unread: never parse it as a request
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, code: int, message: str) -> None:
        """Answer ``code`` and close; log info for a request signed for this node's earlier id (its
        client retries), else a rate-limited warning."""
        routine = message.startswith(NODE_CHANGED)
        say = log.info if routine else self.server.control.refusals
        say("refused %s %s from %s (%d): %s", self.command, self.path[:200],
            self.client_address[0], code, message)
        self._reply(code, {"error": message}, close=True)

    def _serve(self, method: str) -> None:
        control: "ControlServer" = self.server.control
        self.signed_nonce = ""  # set once this request is authenticated
        url = urlsplit(self.path)
        handler = control.routes.get((method, url.path))
        if handler is None:
            known = any(path == url.path for _, path in control.routes)
            self._reply(405 if known else 404, {"error": f"no route {method} {url.path}"}, True)
            return
        length = self._length(url.path in PUBLIC_PATHS)
        if length is None:
            return
        if url.path not in PUBLIC_PATHS:  # a public request stays evictable
            refused = control.auth.check_headers(method, self.path, self.headers)
            if refused is not None:
                self._refuse(401, refused)
                return
            control.slots.authenticated(self.connection)
            if control.auth.enabled:
                self.signed_nonce = self.headers.get(HEADER_NONCE) or ""
        raw = self._read_body(control, url.path, length)
        if raw is None:
            return
        body = self._json(raw) if url.path not in control.raw_routes else {}
        if body is not None:
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            self._dispatch(handler, body, raw, query, f"{method} {url.path}")

    def _length(self, public: bool) -> Optional[int]:
        """The declared body length, or None after answering 400."""
        if self.headers.get("Transfer-Encoding") is not None:
            self._refuse(400, f"unsupported Transfer-Encoding "
                              f"{self.headers['Transfer-Encoding'][:80]!r}")
            return None
        lengths = self.headers.get_all("Content-Length") or ["0"]
        if len(lengths) != 1 or not _LENGTH.fullmatch(lengths[0]):
            self._refuse(400, f"bad Content-Length {', '.join(lengths)[:80]!r}")
            return None
        if public and int(lengths[0]):
            self._refuse(400, f"{self.path[:80]} takes no body")
            return None
        return int(lengths[0])

    def _read_body(self, control: "ControlServer", path: str, length: int) -> Optional[bytes]:
        """The authenticated body within its route's limit and ``body_deadline_s``, or None after
        answering 401/413 or dropping the connection."""
        limit = control.raw_routes[path]() if path in control.raw_routes else MAX_JSON_BODY
        if length > limit:
            control.auth.release(self.headers)
            self._refuse(413, f"body of {length} bytes exceeds the limit of {limit}")
            return None
        body, digest = bytearray(), hashlib.sha256()
        deadline = time.monotonic() + body_deadline_s(length, control.timeout_s)
        try:
            while len(body) < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(body)} of {length} bytes by the deadline")
                self.connection.settimeout(min(control.timeout_s, left))
                chunk = self.rfile.read1(min(_CHUNK, length - len(body)))
                if not chunk:
                    raise ConnectionError(f"closed after {len(body)} of {length} bytes")
                body += chunk
                digest.update(chunk)
            self.connection.settimeout(control.timeout_s)
        except OSError as e:
            control.auth.release(self.headers)
            control.dropped("%s dropped: body of %s %s not received: %s",
                            self.client_address[0], self.command, path, e)
            self.close_connection = True
            return None
        refused = None if path in PUBLIC_PATHS else \
            control.auth.accept(self.headers, digest.hexdigest())
        if refused is not None:
            self.signed_nonce = ""
            self._refuse(401, refused)
            return None
        return body if path in control.raw_routes else bytes(body)

    def _json(self, raw: bytes) -> Optional[Dict[str, Any]]:
        """The body as a JSON object ({} when empty), or None after answering 400."""
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            self._reply(400, {"error": f"body is not JSON: {e}"})
            return None
        except RecursionError:
            self._reply(400, {"error": "body is not JSON this node accepts: nested too deeply"})
            return None
        if not isinstance(body, dict):
            self._reply(400, {"error": f"body must be a JSON object, not {type(body).__name__}"})
            return None
        return body

    def _dispatch(self, handler: Handler, body: Dict[str, Any], raw: bytes,
                  query: Dict[str, str], what: str) -> None:
        code, payload = _answer(handler, body, raw, query, what)
        try:
            self._reply(code, payload)
        except OSError as e:  # the client went away while the handler ran: not our error
            log.debug("%s left before the reply to %s: %s: %s", self.client_address[0], what,
                      type(e).__name__, e)
            self.close_connection = True

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")


def _answer(handler: Handler, body: Dict[str, Any], raw: bytes, query: Dict[str, str],
            what: str) -> Tuple[int, Dict[str, Any]]:
    """``Conflict`` 409, ``RingError`` (a node further down failed) 502, bad input 400, a bug 500.
    """
    try:
        return 200, handler(body, raw, query)
    except Conflict as e:
        return 409, {"error": str(e)}
    except RingError as e:
        return 502, {"error": str(e)}
    except (MdiedgeError, KeyError, TypeError, ValueError) as e:
        return 400, {"error": f"missing key {e}" if isinstance(e, KeyError) else str(e)}
    except Exception as e:  # a bug: answer, log, stay up
        log.exception("control handler %s failed", what)
        return 500, {"error": f"{type(e).__name__}: {e}"}


class _Slots:
    """Connections not past authentication are evictable, oldest first, so silent peers cannot lock
    a client out; a new one is refused only when every one serves an authenticated request."""

    def __init__(self) -> None:
        self.open = 0
        self.unauthenticated: "OrderedDict[socket.socket, None]" = OrderedDict()
        self.lock = threading.Lock()

    def enter(self, sock: socket.socket, limit: int) -> bool:
        with self.lock:
            if self.open >= limit:
                if not self.unauthenticated:
                    return False
                victim, _ = self.unauthenticated.popitem(last=False)
                try:  # its thread sees the connection end and leaves
                    victim.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.open += 1
            self.unauthenticated[sock] = None
            return True

    def leave(self, sock: socket.socket) -> None:
        with self.lock:
            self.open -= 1
            self.unauthenticated.pop(sock, None)

    def authenticated(self, sock: socket.socket) -> None:
        with self.lock:
            self.unauthenticated.pop(sock, None)

    def waiting(self, sock: socket.socket) -> None:
        with self.lock:
            self.unauthenticated[sock] = None


class _Server(ThreadingHTTPServer):
    """At most ``control.max_connections`` threads (``_Slots``); a broken connection is one log
    line."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 drops SYNs in a burst: clients stall 1 s
    control: "ControlServer"

    def get_request(self) -> Tuple[Any, Any]:
        """Out of descriptors, wait first (``AcceptBackoff``): the loop would otherwise spin while
        the shortage lasts."""
        try:
            pair = super().get_request()
        except OSError as e:
            self.control.backoff.failed(e)
            raise  # socketserver drops a failed accept quietly
        self.control.backoff.ok()
        return pair

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.control.slots.enter(request, self.control.max_connections):
            self.control.refusals("refused a control connection from %s: %d connections "
                                  "already open", client_address[0],
                                  self.control.max_connections)
            try:
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.control.slots.leave(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.control.slots.leave(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        peer = isinstance(error, (OSError, http.client.HTTPException))
        (log.debug if peer else self.control.refusals)("control connection from %s ended: "
                                                       "%s: %s", client_address[0],
                                                       type(error).__name__, error)


class ControlServer:
    """Routes ``(method, path)`` to handlers -> JSON reply. ``raw_routes``: paths whose body is
    bytes (weights), with their size limit, handed over as a ``bytearray``. ListenError for a port
    it cannot listen on."""

    def __init__(self, host: str, port: int, routes: Dict[Tuple[str, str], Handler],
                 raw_routes: Optional[Dict[str, Callable[[], int]]] = None,
                 auth: Optional[Authenticator] = None, what: str = "control port") -> None:
        self.routes = dict(routes)
        self.routes[("GET", "/ping")] = self._ping
        self.raw_routes = raw_routes or {}
        # its own id: a request signed for another node is refused here
        self.auth = (auth or Authenticator(None)).for_node(os.urandom(16).hex())
        self.max_connections, self.timeout_s = MAX_CONNECTIONS, CONTROL_SOCKET_TIMEOUT_S
        self.slots = _Slots()
        self.refusals = Throttled(log, logging.WARNING, f"{what}: refused requests")
        self.dropped = Throttled(log, logging.INFO, f"{what}: requests whose body never came")
        try:
            self.httpd = _Server((host, port), _Handler)
        except OSError as e:
            raise ListenError(host, port, what, e) from None
        self.backoff = AcceptBackoff(log, f"{what} {self.port}")
        self.httpd.control = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="control",
                                       args=(defaults.STOP_POLL_S,), daemon=True)

    def _ping(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        return {"pong": True, "node": self.auth.node, "time": time.time()}

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.httpd.server_address[0]
        return f"http://{'[%s]' % host if ':' in str(host) else host}:{self.port}"

    def add_routes(self, routes: Dict[Tuple[str, str], Handler]) -> None:
        self.routes.update(routes)

    def start(self) -> "ControlServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        """A server never started just closes its port (``shutdown`` would wait for a loop that
        never ran)."""
        if self.thread.ident is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.refusals.flush()
        self.dropped.flush()


def round_trip_ms(base_url: str, timeout: float = 2.0) -> Optional[float]:
    """One unauthenticated ping's round trip, or None."""
    import time

    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(base_url + "/ping", timeout=timeout) as response:
            response.read()
    except (urllib.error.URLError, OSError):
        return None
    return round((time.perf_counter() - t0) * 1e3, 3)


_NODE_IDS: Dict[str, str] = {}  # base URL -> the id its control server signs for


def node_id(base_url: str, timeout: float, fresh: bool = False, who: str = "") -> str:
    """The node's ``/ping`` id ("" if none), remembered unless ``fresh``; its clock checked
    (``check_clock``)."""
    if fresh or base_url not in _NODE_IDS:
        sent = time.time()
        reply = _request(base_url, "GET", "/ping", None, {}, False, timeout, base_url)
        check_clock(reply.get("time"), (sent + time.time()) / 2, who or base_url)
        _NODE_IDS[base_url] = str(reply.get("node") or "")
    return _NODE_IDS[base_url]


def check_clock(theirs: Any, ours: float, who: str) -> None:
    """A clock more than ``MAX_SKEW_S`` from ours would make every signed request stale: a RingError
    naming the skew."""
    if not isinstance(theirs, (int, float)) or isinstance(theirs, bool) \
            or not math.isfinite(theirs):
        return  # a node of a release that does not tell its time
    skew = theirs - ours
    if abs(skew) > MAX_SKEW_S:
        raise RingError(f"{who}: its clock is {abs(skew):.0f} s "
                        f"{'ahead of' if skew > 0 else 'behind'} this node's; signed requests "
                        f"need clocks within {MAX_SKEW_S:.0f} s: set the clocks (NTP; a board "
                        f"without a battery-backed clock, such as a Jetson, boots with a "
                        f"wrong one)")


def call(base_url: str, method: str, path: str, body: Optional[Dict[str, Any]] = None,
         raw: Optional[bytes] = None, timeout: float = 30.0, node: str = "",
         auth: Optional[Authenticator] = None) -> Dict[str, Any]:
    """One signed control request, RingError on failure. A 401 after the node drew a new id
    (restarted) is retried once, signed for it."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    who = f"{node} ({base_url})" if node else base_url
    if auth is None or not auth.enabled:
        return _request(base_url, method, path, data, {}, raw is not None, timeout, who)
    def signed_for(target: str) -> Dict[str, Any]:
        headers = auth.sign(method, path, data or b"", target)
        return _request(base_url, method, path, data, headers, raw is not None, timeout, who,
                        auth)

    target = node_id(base_url, timeout, who=who)
    try:
        return signed_for(target)
    except RingError as e:
        if getattr(e, "status", None) != 401 or node_id(base_url, timeout, True, who) == target:
            raise
    log.info("%s restarted since it was last asked (its node id changed): %s %s signed for "
             "its new id and sent again", who, method, path)
    return signed_for(_NODE_IDS[base_url])


def get_json(base_url: str, path: str, headers: Dict[str, str], timeout: float,
             who: str) -> Dict[str, Any]:
    """One unsigned ``GET`` (an HTTP API's); its JSON object, or a RingError."""
    return _request(base_url, "GET", path, None, headers, False, timeout, who)


def _request(base_url: str, method: str, path: str, data: Optional[bytes],
             headers: Dict[str, str], raw: bool, timeout: float, who: str,
             auth: Optional[Authenticator] = None) -> Dict[str, Any]:
    """Its JSON object, or a RingError; with ``auth`` the reply must carry the node's signature."""
    request = urllib.request.Request(base_url + path, data=data, method=method)
    for name, value in headers.items():
        request.add_header(name, value)
    request.add_header("Content-Type", "application/octet-stream" if raw else "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
            refused = None if auth is None else auth.check_reply(
                response.status, headers, body, response.headers.get(HEADER_REPLY))
            if refused is not None:
                raise RingError(f"{who}: {method} {path}: {refused}")
            reply = json.loads(body or b"{}")
    except urllib.error.HTTPError as e:
        error = RingError(f"{who}: {method} {path} refused ({e.code}): {_error_message(e)}")
        error.status = e.code  # type: ignore[attr-defined]
        raise error from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = _one_line(getattr(e, "reason", None) or f"{type(e).__name__}: {e}")
        raise RingError(f"{who} is unreachable: {reason}") from None
    except ValueError as e:
        raise RingError(f"{who}: {method} {path} answered non-JSON: {_one_line(e)}") from None
    if not isinstance(reply, dict):
        raise RingError(f"{who}: {method} {path} answered a JSON {type(reply).__name__}, "
                        f"not an object: {_one_line(reply)}")
    return reply


def _one_line(value: Any, limit: int = 300) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        payload = json.loads(e.read())
        message = payload.get("error", e.reason) if isinstance(payload, dict) else e.reason
        if isinstance(message, dict) and "message" in message:  # an OpenAI-shaped error
            message = message["message"]
    except (ValueError, OSError, http.client.HTTPException):
        message = e.reason
    return _one_line(message)


class ControlClient:
    """Bodies carry ``session`` (a worker serves one starter session at a time) and the
    ``starter``'s name (a restarted starter takes its workers over)."""

    def __init__(self, node: NodeSpec, auth: Optional[Authenticator] = None,
                 session: str = "", starter: str = "") -> None:
        self.node, self.auth, self.session, self.starter = node, auth, session, starter

    def call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
             raw: Optional[bytes] = None, timeout: float = 30.0) -> Dict[str, Any]:
        if body is not None and self.session:
            body = dict(body, session=self.session, starter=self.starter)
        return call(self.node.url, method, path, body, raw, timeout, self.node.name, self.auth)

    def status(self, role: str = "worker", timeout: float = 5.0) -> NodeStatus:
        """A ``down`` status saying why, when it does not answer."""
        try:
            status = NodeStatus.from_json(self.call("GET", "/status", timeout=timeout))
        except RingError as e:
            return NodeStatus.down(role, self.node.name, self.node.address, str(e))
        status.address = self.node.address
        return status
