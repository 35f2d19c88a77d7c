"""A worker node: receive activations, run its blocks, send on. It loads its assigned range from its
own copy of the model when the content hash matches, else its on-disk cache, else asks the starter
for exactly its tensors (and caches them). Its compute is a ``LocalStage``, as the starter's."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

from .. import __version__
from ..base import defaults
from ..base.codecs import Compression
from ..base.errors import ConfigError, Conflict, MdiedgeError, RingError
from ..base.accel import running_code, warn_if_uncompiled
from ..base.memory import max_rss_bytes, rss_bytes
from ..base.threads import compute_threads
from ..base.humanize import block_range
from ..model.chunks import open_chunk
from ..model.hub import resolve_model
from ..model.modelfile import model_file, reads
from ..runtime import messages
from ..runtime.auth import Authenticator, is_loopback
from ..runtime.compute import ComputeThread
from ..runtime.control import ControlServer, round_trip_ms
from ..runtime.links import LinkDown, LinkPair, accept_authenticated, bind, close_links, \
    close_quietly, connect_authenticated, tcp_listen
from ..runtime.protocol import Assignment, AssignReply, ConnectRequest, ModelRef, NodeStatus
from ..runtime.stages import LocalStage, inference
from .devices import device_of
from .earlyexit import cache_suffix, extra_bytes, has_parts, keep_sent_classifier, worker_policy

log = logging.getLogger("mdiedge.worker")

TEST_PAUSE_ENV = "MDIEDGE_TEST_PAUSE"  # tests only: "NAME:POINT:SECONDS", see pause_for_tests


def pause_for_tests(name: str, point: str) -> None:
    """Tests only: worker ``name`` sleeps at ``point`` (``/assign``, ``/connect``, ``links``) when
    ``$MDIEDGE_TEST_PAUSE`` says so ("w2:/assign:4"), to be killed or frozen at a known set-up step.
    """
    spec = os.environ.get(TEST_PAUSE_ENV, "").split(":")
    if len(spec) == 3 and spec[:2] == [name, point]:
        time.sleep(float(spec[2]))


def cache_folder(cache_dir: Path, request: Assignment) -> Path:
    a, b = request.layers
    return cache_dir / "weights" / request.model.hash / \
        f"layers-{a}-{b}{cache_suffix(request.early_exit)}"




class WorkerNode:
    def __init__(self, host: str = "127.0.0.1", control_port: int = 0, data_port: int = 0,
                 cache_dir: Optional[Path] = None, name: str = "worker",
                 secret: Optional[bytes] = None, insecure: bool = False,
                 idle_timeout_s: float = defaults.IDLE_TIMEOUT_S, heartbeat: Any = None,
                 busy_poll_us: int = defaults.BUSY_POLL_US, encrypt: bool = True) -> None:
        if secret is None and not insecure and not is_loopback(host):
            raise ConfigError(f"refusing to listen on {host} without a ring secret "
                              f"(set one, or pass --insecure on a trusted network)")
        self.name, self.host = name, host
        self.auth = Authenticator(secret)
        self.idle_timeout_s = idle_timeout_s
        self.busy_poll_us = busy_poll_us  # of its inbound link: see LinkPair
        self.encrypt = encrypt  # seal its links (False: --no-encrypt, for measurements only)
        self.heartbeat = heartbeat  # fed by the compute loop: the systemd watchdog reads it
        self.owner = ""  # session of the starter this worker serves; "" when free
        self.owner_seen = 0.0
        self.owner_name = ""  # the name that starter signs its requests with
        self.cache_dir = cache_dir or defaults.default_cache_dir()
        self.state = "idle"
        self.started = time.time()
        self.assignment: Optional[Assignment] = None  # what the loaded model is
        self.model: Any = None
        self.source = Path()  # where the loaded model's tensors came from
        self.stage: Optional[LocalStage] = None
        self.pending: Optional[Assignment] = None  # an assignment waiting for weights
        self.next_control: Optional[str] = None
        self.lock = threading.Lock()
        self.compute = ComputeThread()  # loading, the stage's KV and serving the ring's links
        self.links: Optional[LinkPair] = None
        self.ring_id = 0  # bumped by every connect and reset; a stale ring thread cleans nothing
        self.stopped = threading.Event()
        self.listener = tcp_listen(host, data_port)
        self.control = ControlServer(host, control_port, {
            ("GET", "/status"): self.status,
            ("POST", "/assign"): self.assign,
            ("PUT", "/weights"): self.receive_weights,
            ("POST", "/connect"): self.connect,
            ("POST", "/reset"): self.reset,
            ("POST", "/shutdown"): self.shutdown,
        }, raw_routes={"/weights": self._weights_limit}, auth=self.auth)

    @property
    def data_port(self) -> int:
        return int(self.listener.getsockname()[1])

    def start(self) -> "WorkerNode":
        self.control.start()
        threading.Thread(target=self._expire_owner, name="lease", daemon=True).start()
        return self

    def _claim(self, session: str, starter: str = "") -> None:
        """One starter at a time: another is refused while the owner's lease holds (ring up, or
        heard within ``idle_timeout_s``), but the owner's ``starter`` name in a new signed session
        (restarted) takes over."""
        now = time.time()
        if self.owner and self.owner != session and (
                self.state in ("busy", "loading") or now - self.owner_seen < self.idle_timeout_s):
            if not (starter and starter == self.owner_name and self.auth.enabled):
                raise Conflict(f"{self.name} is serving another starter; try again when it "
                               f"is done")
            log.warning("%s: starter %r is back in a new session: it takes over, the old "
                        "session's ring is ended", self.name, starter)
            self.ring_id += 1
            self._end_ring()
        self.owner, self.owner_name, self.owner_seen = session, starter, now

    def _expire_owner(self) -> None:
        """Free the slots and go idle when the owner has gone away."""
        while not self.stopped.wait(1.0):
            with self.lock:
                if self.owner and self.state != "busy" and \
                        time.time() - self.owner_seen > self.idle_timeout_s:
                    log.info("%s: starter silent for %.0f s; back to idle", self.name,
                             self.idle_timeout_s)
                    self.owner = ""
                    self._end_ring()

    def serve_forever(self) -> None:
        self.stopped.wait()
        self.close()

    def close(self) -> None:
        self._drop_links()
        self.control.stop()
        close_quietly(self.listener)
        self.compute.close()

    # ----------------------------------------------------------------- control handlers

    def status(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        a, stage = self.assignment, self.stage
        status = NodeStatus(
            "worker", self.name, self.state, address=f"{self.host}:{self.control.port}",
            version=__version__, rss_bytes=rss_bytes(), max_rss_bytes=max_rss_bytes(),
            uptime_s=round(time.time() - self.started, 1), pid=os.getpid(),
            data_port=self.data_port, threads=compute_threads(), code=running_code(),
            file_reads=reads(), sealed=self.encrypt,
            # a short limit: a frozen next node must not make this node look frozen too
            link_rtt_ms=round_trip_ms(self.next_control, defaults.STATUS_RTT_TIMEOUT_S)
            if self.next_control and self.state == "busy" else None)
        if a is not None:
            status.model, status.hash, status.device = a.model.name, a.model.hash, a.device
            status.layers = list(a.layers)
        status.links = links.stats() if (links := self.links) is not None else {}
        if stage is not None:
            stage.describe(status)
        elif self.model is not None:  # loaded, its ring gone: what it holds
            status.weight_bytes = self.model.parameter_bytes()
            status.kv_bytes = self.model.kv_cache_bytes()
        return status.to_json()

    def assign(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        """Load the range, or ask for weights with ``need_weights``."""
        request = Assignment.from_json(body)
        device_of(request.device, "device")
        with self.lock:
            self._claim(request.session, str(body.get("starter", "")))
            if self.state == "busy":
                raise Conflict(f"{self.name} is serving a ring already")
            pause_for_tests(self.name, "/assign")
            if not (request.same_weights(self.assignment) and self.model is not None
                    and has_parts(self.source, request.early_exit)):
                source = self._find_local_copy(request)
                if source is None:
                    self.pending = request
                    return AssignReply(True).to_json()
                self._load(source, request)
            self.compute.call(self._setup_stage, request)
        return self._ready_reply().to_json()

    def _ready_reply(self) -> AssignReply:
        return AssignReply(False, self.data_port, self.model.parameter_bytes(),
                           self.model.kv_cache_bytes())

    def _weights_limit(self) -> int:
        pending = self.pending
        if pending is None:
            return 0
        a, b = pending.layers
        return (b - a) * pending.model.model_config().block_params() * 4 + (1 << 20) \
            + extra_bytes(pending)

    def receive_weights(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        """Exactly the pending range's safetensors: cached, then loaded."""
        with self.lock:
            self._claim(query.get("session", ""), query.get("starter", ""))
            request = self.pending
            if request is None or query.get("hash") != request.model.hash:
                raise Conflict("no pending assignment for these weights")
            folder = self._cache_weights(request, raw)
            self._load(folder, request)
            self.compute.call(self._setup_stage, request)
            self.pending = None
        return self._ready_reply().to_json()

    def _cache_weights(self, request: Assignment, raw: bytes) -> Path:
        folder = cache_folder(self.cache_dir, request)
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "model.safetensors").write_bytes(raw)
        if request.early_exit is not None and request.early_exit.needs_classifier:
            keep_sent_classifier(tmp)
        (tmp / "config.json").write_text(json.dumps(request.model.config))
        if request.model.generation_config:
            (tmp / "generation_config.json").write_text(json.dumps(request.model.generation_config))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        return folder

    def connect(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        request = ConnectRequest.from_json(body)
        with self.lock:
            self._claim(request.session, str(body.get("starter", "")))
            if self.stage is None:
                raise Conflict(f"{self.name} has no layers assigned")
            if self.state == "busy":
                raise Conflict(f"{self.name} is serving a ring already")
            self._drop_links()
            self.next_control = request.next_control
            self.state = "busy"
            self.ring_id += 1
            ring_id = self.ring_id
            pause_for_tests(self.name, "/connect")
        threading.Thread(target=self._serve_ring, args=(request, ring_id), name="ring",
                         daemon=True).start()
        return {"state": "busy"}

    def reset(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        with self.lock:
            self._claim(str(body.get("session", "")), str(body.get("starter", "")))
            if body.get("release"):  # the starter is done with this worker
                self.owner = ""
            self.ring_id += 1
            self._end_ring()
        return {"state": self.state}

    def shutdown(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        self.stopped.set()
        return {"state": "stopping"}

    # ----------------------------------------------------------------- loading

    def preload(self, model: str, layers: Optional[Any], device: str, dtype: str) -> None:
        """So an assignment of the same range of the same model (by content hash) finds it ready."""
        path = resolve_model(model)
        file = model_file(path)
        first, last = layers if layers is not None else (0, file.cfg.n_layers)
        ref = ModelRef(file.cfg.name, file.content_hash(), {}, {})
        self._load(path, Assignment(ref, (first, last), 1, 1, dtype, device))
        self.state = "idle"

    def _find_local_copy(self, request: Assignment) -> Optional[Path]:
        path = request.model.path
        if path and Path(path).exists():
            try:
                if model_file(Path(path)).content_hash() == request.model.hash:
                    return Path(path)
            except OSError:
                pass
        cached = cache_folder(self.cache_dir, request)
        if (cached / "model.safetensors").exists() and has_parts(cached, request.early_exit):
            return cached
        return None

    def _load(self, source: Path, request: Assignment) -> None:
        self.state = "loading"
        self.model, self.stage, self.assignment = None, None, None
        log.info("%s: loading blocks %s from %s", self.name, block_range(request.layers), source)
        torch_for = None if request.early_exit is None else "early exit"
        self.model = self.compute.call(
            open_chunk, source, tuple(request.layers), False, False,
            device_of(request.device, "device"), request.dtype, request.quantize or None,
            torch_for)
        warn_if_uncompiled()
        self.assignment, self.source = request, source
        self.state = "ready"

    def _setup_stage(self, request: Assignment) -> None:
        """On the compute thread."""
        policy = worker_policy(self.source, request)
        self.stage = LocalStage(self.model, request.n_slots, request.context,
                                trim_prefill=request.last, exit_policy=policy)
        self.assignment = request

    # ----------------------------------------------------------------- data plane

    def _end_ring(self) -> None:
        self._drop_links()
        if self.stage is not None:
            self.stage.clear()
        self.state = "ready" if self.owner and self.model is not None else "idle"

    def _drop_links(self) -> None:
        if self.links is not None:
            self.links.close(timeout=1)
        self.links = None

    def _open_links(self, request: ConnectRequest, ring_id: int) -> Optional[LinkPair]:
        """Inbound first (the starter does the opposite, so no cycle waits), bound to the ring tag;
        a reset or newer connect cancels. None (every socket closed) on failure."""
        assert self.assignment is not None
        return _link_pair(self.listener, bind(self.auth, request.ring), request, self.name,
                          self.assignment.max_payload, lambda: self.ring_id != ring_id,
                          self.busy_poll_us, self.encrypt)

    def _serve_ring(self, request: ConnectRequest, ring_id: int) -> None:
        pause_for_tests(self.name, "links")
        links = self._open_links(request, ring_id)
        with self.lock:
            if links is None or self.ring_id != ring_id:  # failed, or reset while waiting
                if links is not None:
                    links.close(timeout=0)
                if self.ring_id == ring_id:
                    self._end_ring()
                return
            self.links = links
        try:
            self.compute.call(self._compute_loop, links)
        except MdiedgeError as e:
            log.error("%s: %s; closing the ring links", self.name, e)
        except Exception:
            log.exception("%s: compute failed; closing the ring links", self.name)
        with self.lock:
            if self.ring_id == ring_id:
                self._end_ring()

    def _compute_loop(self, links: LinkPair) -> None:
        if self.stage is None:
            raise RingError(f"{self.name}: no stage to run")
        compute_loop(self.name, self.stage, links, self.heartbeat)


def compute_loop(name: str, stage: LocalStage, links: LinkPair, heartbeat: Any) -> None:
    """Until the inbound link ends or the starter ends the ring; ``heartbeat`` (or None) is fed."""
    busy = heartbeat.busy if heartbeat is not None else contextlib.nullcontext
    with inference():  # once, not for every message
        while True:
            item = links.receive()
            if isinstance(item, LinkDown):
                log.debug("%s: inbound link down: %s", name, item.reason)  # the link logged it
                return
            with busy():  # the send is outside: a slow next node is not this node's stall
                out = stage.forward(item)
            links.send(out)
            if item.kind == messages.SHUTDOWN:
                log.info("%s: the starter ended the ring", name)
                return


def _link_pair(listener: Any, auth: Authenticator, request: ConnectRequest, name: str,
               max_payload: int, moved_on: Any, busy_poll_us: int,
               encrypt: bool) -> Optional[LinkPair]:
    """Inbound first, with the request's codecs, sealed unless not ``encrypt``; ``moved_on()``
    cancels. None (every socket closed) on any failure."""
    codecs_in, codecs_out = (Compression.parse(c) for c in (request.codecs_in,
                                                            request.codecs_out))
    inbound = None
    try:
        inbound = accept_authenticated(listener, auth, defaults.LINK_ACCEPT_TIMEOUT_S, name,
                                       cancelled=moved_on, codecs=codecs_in, seal=encrypt)
        outbound = connect_authenticated(request.next_host, request.next_port, auth,
                                         f"next node {request.next_host}:{request.next_port}",
                                         retry_s=defaults.LINK_RETRY_S, cancelled=moved_on,
                                         codecs=codecs_out, seal=encrypt)
        return LinkPair(inbound, outbound, max_payload, name, codecs_in, codecs_out,
                        inline_receive=True, busy_poll_us=busy_poll_us)
    except Exception as e:  # OSError, AuthError (a RingError), or anything else
        side = "no previous node connected" if inbound is None else "cannot reach its next node"
        # the starter's reset (a Ctrl-C, a new set-up) is no fault: a terminal shows no warning
        (log.info if moved_on() else log.warning)("%s: %s: %s", name, side, e)
        close_links(inbound)
        return None
