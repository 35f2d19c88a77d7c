"""A worker node: receive activations, run its blocks with each message's KV slots, send on.

The starter assigns the block range over the control plane; the worker loads those layers
from its own copy of the model when the content hash matches, else from its on-disk cache,
else asks the starter for exactly its tensors (and caches them under the hash).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from ..runtime import framing
from ..base.accel import select
from ..runtime.auth import AuthError, Authenticator, is_loopback
from ..model.checkpoint import content_hash, load_model
from ..model.config import config_from_hf
from .. import __version__
from ..runtime.control import Conflict, ControlServer, round_trip_ms
from .engine import parse_device, parse_dtype
from ..base.errors import ConfigError, MdiedgeError, RingError
from ..runtime.links import (DEFAULT_MAX_PAYLOAD, LinkDown, Receiver, Sender, accept, close_quietly,
                        tcp_connect, tcp_listen)

log = logging.getLogger("mdiedge.worker")

ACCEPT_TIMEOUT_S = 30.0


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("MDIEDGE_CACHE_DIR") or os.path.join(base, "mdiedge"))


class WorkerNode:
    def __init__(self, host: str = "127.0.0.1", control_port: int = 0, data_port: int = 0,
                 cache_dir: Optional[Path] = None, name: str = "worker",
                 secret: Optional[bytes] = None, insecure: bool = False,
                 idle_timeout_s: float = 60.0) -> None:
        if secret is None and not insecure and not is_loopback(host):
            raise ConfigError(f"refusing to listen on {host} without a ring secret "
                              f"(set one, or pass --insecure on a trusted network)")
        self.name = name
        self.auth = Authenticator(secret)
        self.idle_timeout_s = idle_timeout_s
        self.owner = ""  # session of the starter this worker serves; "" when free
        self.owner_seen = 0.0
        self.cache_dir = cache_dir or default_cache_dir()
        self.state = "idle"
        self.started = time.time()
        self.assignment: Dict[str, Any] = {}
        self.model: Any = None
        self.slots: Any = None
        self.pending: Optional[Dict[str, Any]] = None  # an assignment waiting for weights
        self.lock = threading.Lock()
        self.links: Tuple[Any, Any] = (None, None)
        self.ring_id = 0  # bumped by every connect and reset; a stale ring thread cleans nothing
        self.stats = {"messages": 0, "tokens": 0, "compute_s": 0.0, "connected_at": 0.0}
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

    def _claim(self, session: str) -> None:
        """Serve only one starter at a time: another is refused while the owner's lease holds
        (the ring is up, or the owner spoke within ``idle_timeout_s``)."""
        now = time.time()
        if self.owner and self.owner != session and (
                self.state in ("busy", "loading") or now - self.owner_seen < self.idle_timeout_s):
            raise Conflict(f"{self.name} is serving another starter; try again when it is done")
        self.owner, self.owner_seen = session, now

    def _expire_owner(self) -> None:
        """Free the slots and return to idle when the owning starter has gone away."""
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

    # ----------------------------------------------------------------- control handlers

    def status(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        wall = time.time() - self.stats["connected_at"] if self.stats["connected_at"] else 0.0
        next_node = self.assignment.get("next_control")
        return {
            "role": "worker", "name": self.name, "state": self.state, "version": __version__,
            "rss_bytes": rss_bytes(),
            "link_rtt_ms": round_trip_ms(next_node) if next_node and self.state == "busy" else None,
            "layers": self.assignment.get("layers"), "model": self.assignment.get("model_name"),
            "hash": self.assignment.get("hash"), "device": self.assignment.get("device"),
            "weight_bytes": self.model.parameter_bytes() if self.model is not None else 0,
            "kv_bytes": self.model.kv_cache_bytes() if self.model is not None else 0,
            "expert_load": self.model.expert_load() if self.model is not None else {},
            "slots_in_use": self.slots.in_use if self.slots is not None else 0,
            "messages": self.stats["messages"], "tokens": self.stats["tokens"],
            "compute_s": round(self.stats["compute_s"], 6), "max_rss_bytes": max_rss_bytes(),
            "busy_fraction": round(self.stats["compute_s"] / wall, 4) if wall > 0 else 0.0,
            "uptime_s": round(time.time() - self.started, 1), "pid": os.getpid(),
            "data_port": self.data_port,
        }

    def assign(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        """Take a layer range; load it (or ask for weights with ``need_weights``)."""
        request = _parse_assignment(body)
        with self.lock:
            self._claim(str(body.get("session", "")))
            if self.state == "busy":
                raise Conflict(f"{self.name} is serving a ring already")
            same = {k: self.assignment.get(k) for k in ("hash", "layers", "dtype", "device")} == \
                   {k: request[k] for k in ("hash", "layers", "dtype", "device")}
            if not (same and self.model is not None):
                source = self._find_local_copy(request)
                if source is None:
                    self.pending = request
                    return {"need_weights": True}
                self._load(source, request)
            self._setup_cache(request)
        return {"need_weights": False, "data_port": self.data_port,
                "weight_bytes": self.model.parameter_bytes(),
                "kv_bytes": self.model.kv_cache_bytes()}

    def _weights_limit(self) -> int:
        pending = self.pending
        if pending is None:
            return 0
        cfg = pending["cfg"]
        a, b = pending["layers"]
        return (b - a) * cfg.block_params() * 4 + (1 << 20)

    def receive_weights(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        """The starter's safetensors of exactly the pending range: cache them, then load."""
        with self.lock:
            self._claim(query.get("session", ""))
            request = self.pending
            if request is None or query.get("hash") != request["hash"]:
                raise Conflict("no pending assignment for these weights")
            folder = self._cache_folder(request)
            tmp = folder.with_name(folder.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "model.safetensors").write_bytes(raw)
            (tmp / "config.json").write_text(json.dumps(request["config"]))
            if request.get("generation_config"):
                (tmp / "generation_config.json").write_text(json.dumps(request["generation_config"]))
            if folder.exists():
                import shutil

                shutil.rmtree(folder)
            os.replace(tmp, folder)
            self._load(folder, request)
            self._setup_cache(request)
            self.pending = None
        return {"need_weights": False, "data_port": self.data_port, "cached": str(folder),
                "weight_bytes": self.model.parameter_bytes(),
                "kv_bytes": self.model.kv_cache_bytes()}

    def connect(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        """Open the link to the next node, wait for the previous one, start the threads."""
        host, port = str(body["next_host"]), int(body["next_port"])
        self.assignment["next_control"] = str(body.get("next_control") or "") or None
        with self.lock:
            self._claim(str(body.get("session", "")))
            if self.model is None:
                raise Conflict(f"{self.name} has no layers assigned")
            if self.state == "busy":
                raise Conflict(f"{self.name} is serving a ring already")
            self._drop_links()
            try:
                out_sock = tcp_connect(host, port)
            except OSError as e:
                raise RingError(f"{self.name} cannot reach its next node {host}:{port}: {e}") from None
            self.state = "busy"
            self.ring_id += 1
            ring_id = self.ring_id
        threading.Thread(target=self._serve_ring, args=(out_sock, ring_id), name="ring",
                         daemon=True).start()
        return {"state": self.state}

    def reset(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        with self.lock:
            self._claim(str(body.get("session", "")))
            if body.get("release"):  # the starter is done with this worker
                self.owner = ""
            self.ring_id += 1
            self._end_ring()
        return {"state": self.state}

    def shutdown(self, body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        self.stopped.set()
        return {"state": "stopping"}

    # ----------------------------------------------------------------- loading

    def preload(self, model: str, layers: Optional[Tuple[int, int]], device: str,
                dtype: str) -> None:
        """Load a configured block range before serving, so an assignment of the same range
        of the same model (by content hash) finds it ready."""
        from ..model.checkpoint import load_config, resolve_model_path

        path = resolve_model_path(model)
        cfg = load_config(path)
        first, last = layers if layers is not None else (0, cfg.n_layers)
        self._load(path, {"hash": content_hash(path), "layers": [first, last], "dtype": dtype,
                          "device": device, "model_name": cfg.name})
        self.state = "idle"

    def _cache_folder(self, request: Dict[str, Any]) -> Path:
        a, b = request["layers"]
        return self.cache_dir / "weights" / request["hash"] / f"layers-{a}-{b}"

    def _find_local_copy(self, request: Dict[str, Any]) -> Optional[Path]:
        path = request.get("path")
        if path and Path(path).exists():
            try:
                if content_hash(Path(path)) == request["hash"]:
                    return Path(path)
            except OSError:
                pass
        cached = self._cache_folder(request)
        return cached if (cached / "model.safetensors").exists() else None

    def _load(self, source: Path, request: Dict[str, Any]) -> None:
        self.state = "loading"
        self.model = None
        log.info("%s: loading layers %s from %s", self.name, request["layers"], source)
        self.model = load_model(source, layers=tuple(request["layers"]), embedding=False,
                                head=False, device=request["device"],
                                dtype=parse_dtype(request["dtype"]))
        self.assignment = {k: request[k] for k in ("hash", "layers", "dtype", "device")}
        self.assignment["model_name"] = request["model_name"]
        self.state = "ready"

    def _setup_cache(self, request: Dict[str, Any]) -> None:
        self.model.setup_cache(request["n_slots"], request["context"])
        self.slots = select("slots").SlotTable(request["n_slots"])
        self.assignment.update(n_slots=request["n_slots"], context=request["context"],
                               last=request["last"], max_payload=request["max_payload"])

    # ----------------------------------------------------------------- data plane

    def _end_ring(self) -> None:
        self._drop_links()
        if self.slots is not None:
            self.slots.clear()
        self.state = "ready" if self.owner and self.model is not None else "idle"

    def _drop_links(self) -> None:
        for sock in self.links:
            close_quietly(sock)
        self.links = (None, None)

    def _serve_ring(self, out_sock: Any, ring_id: int) -> None:
        try:  # inbound first, then outbound: the starter does the opposite, so no cycle waits
            in_sock = self._accept_authenticated()
            self.auth.connect_link(out_sock, "next node %s:%s" % out_sock.getpeername()[:2],
                                   timeout=ACCEPT_TIMEOUT_S)
        except (AuthError, OSError) as e:
            log.warning("%s: no previous node connected: %s", self.name, e)
            close_quietly(out_sock)
            with self.lock:
                if self.ring_id == ring_id:
                    self._end_ring()
            return
        with self.lock:
            if self.ring_id != ring_id:  # reset while waiting
                close_quietly(in_sock)
                close_quietly(out_sock)
                return
            self.links = (in_sock, out_sock)
        inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        receiver = Receiver(in_sock, inbox, self.assignment["max_payload"], f"{self.name}/recv")
        sender = Sender(out_sock, f"{self.name}/send")
        receiver.start()
        sender.start()
        self.stats["connected_at"] = time.time()
        self.stats["compute_s"] = 0.0
        try:
            self._compute_loop(inbox, sender)
        except MdiedgeError as e:
            log.error("%s: %s; closing the ring links", self.name, e)
        except Exception:
            log.exception("%s: compute failed; closing the ring links", self.name)
        sender.close()
        with self.lock:
            if self.ring_id == ring_id:
                self._end_ring()

    def _accept_authenticated(self) -> Any:
        """The previous node's link: connections that fail the handshake are dropped."""
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        while True:
            sock = accept(self.listener, max(0.1, deadline - time.monotonic()))
            peer = "%s:%s" % sock.getpeername()[:2]
            try:
                self.auth.accept_link(sock, peer)
                return sock
            except (AuthError, OSError) as e:
                log.warning("%s: %s", self.name, e)
                close_quietly(sock)
                if time.monotonic() > deadline:
                    raise OSError(f"no authenticated previous node: {e}") from None

    def _compute_loop(self, inbox: "queue.SimpleQueue[Any]", sender: Sender) -> None:
        model, slots = self.model, self.slots
        device = parse_device(self.assignment["device"])
        dtype = parse_dtype(self.assignment["dtype"])
        last = self.assignment["last"]
        while True:
            item = inbox.get()
            if isinstance(item, LinkDown):
                log.info("%s: inbound link down: %s", self.name, item.reason)
                return
            header, x = item
            t0 = time.perf_counter()
            ids, positions = header.sample_ids, header.positions
            if header.msg_type == framing.ACTIVATION:
                prefill = bool(header.flags & framing.FLAG_PREFILL)
                rows = [slots.get_or_allocate(i) if prefill and p == 0 else slots.slot_of(i)
                        for i, p in zip(ids, positions)]
                with torch.inference_mode():
                    y = model.run_blocks(x.to(device=device, dtype=dtype),
                                         torch.tensor(rows, device=device), list(positions))
                if last and prefill:
                    y = y[:, -1:]  # the starter's head needs only the last position
                sender.put((framing.ACTIVATION, header.flags, ids, positions,
                            y.to("cpu").contiguous(), header.seq))
                self.stats["tokens"] += x.shape[0] * x.shape[1]
            elif header.msg_type == framing.RELEASE:
                held = slots.assignments()
                for i in ids:
                    if i in held:
                        slots.free(i)
                sender.put((framing.RELEASE, 0, ids, positions, None, header.seq))
            elif header.msg_type in (framing.PING, framing.SHUTDOWN):  # echoed with payload
                sender.put((header.msg_type, 0, ids, positions, x, header.seq))
                if header.msg_type == framing.SHUTDOWN:
                    return
            self.stats["messages"] += 1
            self.stats["compute_s"] += time.perf_counter() - t0


def rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return max_rss_bytes()


def max_rss_bytes() -> int:
    """Peak resident memory of this process image: ``VmHWM`` on Linux, because ``ru_maxrss``
    carries over the peak of the parent that forked this process across ``exec``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _parse_assignment(body: Dict[str, Any]) -> Dict[str, Any]:
    """Validate an /assign request body; raises ValueError/KeyError naming the field."""
    model = body["model"]
    cfg = config_from_hf(model["config"], "assignment config", model.get("generation_config"))
    a, b = (int(v) for v in body["layers"])
    if not 0 <= a < b <= cfg.n_layers:
        raise ValueError(f"layers {[a, b]} outside the model's 0..{cfg.n_layers}")
    n_slots, context = int(body["n_slots"]), int(body["context"])
    if not 0 < n_slots <= 4096 or not 0 < context <= cfg.max_seq_len:
        raise ValueError(f"n_slots={n_slots} or context={context} out of range")
    parse_dtype(str(body["dtype"]))
    parse_device(str(body["device"]))
    digest = str(model["hash"])
    if not (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise ValueError(f"model hash {digest!r} is not a sha256 hex digest")
    return {"model_name": str(model.get("name", "")), "hash": digest, "path": model.get("path"),
            "config": model["config"], "generation_config": model.get("generation_config"),
            "cfg": cfg, "layers": [a, b], "n_slots": n_slots, "context": context,
            "dtype": str(body["dtype"]), "device": str(body["device"]),
            "last": bool(body.get("last", False)),
            "max_payload": int(body.get("max_payload", DEFAULT_MAX_PAYLOAD))}
