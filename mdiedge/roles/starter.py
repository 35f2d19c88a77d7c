"""The starter node: the embedding, its first blocks, the head and the sampler, and the ring it sets
up over the control plane. ``engine.ring.RingEngine`` wraps it as an engine."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .. import __version__
from ..base import defaults
from ..base.codecs import Compression
from ..base.dtypes import compute_dtype
from ..base.errors import (ConfigError, Conflict, GenerationError, NodeLost, PartitionError,
                           RingError)
from ..base.accel import running_code
from ..base.memory import max_rss_bytes, rss_bytes
from ..base.threads import compute_threads
from ..base.nodes import NodeSpec, StarterOptions
from ..base.humanize import block_range
from ..model.chunks import open_chunk
from ..model.modelfile import model_file, reads
from ..model.families import config_to_hf
from ..runtime.auth import Authenticator
from ..runtime.control import ControlClient, round_trip_ms
from ..runtime.links import LinkPair, accept_authenticated, bind, close_links, close_quietly, \
    connect_authenticated, tcp_listen
from ..placement.partition import Placement, partition
from ..runtime.compute import ComputeThread
from ..runtime.pipeline import EmbedAndHead, Pipeline
from ..runtime.protocol import (MAX_SLOTS, Assignment, AssignReply, ConnectRequest, ModelRef,
                                NodeStatus)
from ..runtime.plan import layout_for
from ..runtime.scheduler import Scheduler, prefill_rows
from ..runtime.stages import LocalStage
from ..placement import balance
from .devices import device_of
from .earlyexit import check_ring_exits, exit_assignment, sent_chunk, starter_policy
from .membership import Membership
from ..runtime.ring import RingStages, probe_all
from .setupwatch import SetupWatch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..model.earlyexit.files import ExitSettings

log = logging.getLogger("mdiedge.starter")

# Maps a data endpoint (host, port) to the address a link to it connects to instead, e.g. a
# delaying relay in front of it (``mdiedge.tools.relay.Relays``); the wire protocol is the same.
Route = Callable[[str, int], Tuple[str, int]]


def _direct(host: str, port: int) -> Tuple[str, int]:
    return host, port


def ring_message_rows(options: StarterOptions, cfg: Any) -> Tuple[int, int]:
    """(prompt tokens per prefill message, most rows per decode message: what a ``max_payload``
    frame holds)."""
    row_bytes = cfg.dim * compute_dtype(options.dtype).itemsize
    if options.max_payload < row_bytes:  # no frame could carry a token: every hop would fail
        raise ConfigError(f"max_payload = {options.max_payload} bytes cannot carry one token's "
                          f"hidden state ({cfg.dim} x {compute_dtype(options.dtype).itemsize} bytes): raise "
                          f"max_payload to at least {row_bytes} bytes")
    return (prefill_rows(options.prefill_chunk, options.max_payload, row_bytes),
            prefill_rows(0, options.max_payload, row_bytes))


class RingStarter:

    def __init__(self, path: Path, cfg: Any, workers: Sequence[NodeSpec], options: StarterOptions,
                 early_exit: Optional[ExitSettings] = None, route: Optional[Route] = None) -> None:
        if not workers:
            raise RingError("a ring needs at least one worker (use the local engine for one node)")
        self.path, self.cfg, self.options = path, cfg, options
        self.route = route or _direct  # where each ring link connects to reach its endpoint
        self.early_exit = check_ring_exits(cfg, early_exit)
        self.codecs = {w.name: Compression.parse(w.compression or options.compression,
                                                 f"compression of {w.name!r}")
                       for w in list(workers) + [options.spec]}  # of the link into each
        self.device = device_of(options.device)
        self.auth = Authenticator(options.secret)
        self.session = os.urandom(8).hex()  # workers serve one starter session at a time
        self.clients = [ControlClient(w, self.auth, self.session, options.name)
                        for w in workers]
        self.membership = Membership(self.clients, sealed=options.encrypt)
        self.watch = SetupWatch(options.stall_s)  # set-up steps under the stall rule
        self.recoveries = 0
        self.measured: Dict[str, float] = {}  # weights from measured speed, by node name
        self.pinned: Tuple[Tuple[str, ...], Dict[str, Tuple[int, int]]] = ((), {})  # the last
        #     balancing step's ranges, for the ring of these nodes (starter first)
        self.evidence = balance.Evidence()  # of the current ring's balance checks
        self._balanced_at = 0  # the scheduler's message count at the last balance check
        self.hash = model_file(path).content_hash()
        self.model: Any = None
        self.placements: List[Placement] = []
        self.scheduler: Optional[Scheduler] = None
        self.tail: Optional[RingStages] = None
        self.started = time.time()
        self.listener = tcp_listen(options.host, 0)
        self.setup_lock = threading.RLock()  # set-up, submission and closing, one at a time
        self.compute = ComputeThread()  # the starter's torch work: loading, stage, stepping
        self.rings = 0  # rings closed so far: the current ring's number

    @property
    def workers(self) -> List[NodeSpec]:
        """Spares included."""
        return [c.node for c in self.clients]

    @property
    def members(self) -> List[ControlClient]:
        return self.membership.members

    @property
    def ring_workers(self) -> List[NodeSpec]:
        """In ring order."""
        return self.membership.nodes

    # ----------------------------------------------------------------- set-up

    def ensure(self, n_slots: int, context: int) -> Scheduler:
        """The ring's scheduler holding at least ``n_slots`` x ``context``: the current one, else a
        ring set up anew (never smaller), which needs the current one idle (Conflict otherwise)."""
        with self.setup_lock:
            current = self.scheduler
            running = current is not None and current.usable and not current.idle
            usable = running or current is not None and current.usable and \
                self.ring_alive() and not self.membership.rejoin.is_set()  # busy: it recovers
            layout = layout_for(None if current is None else current.pipeline.layout, usable,
                                not running, (n_slots, context))
            if layout is None and (running or not self._rebalance(current)):
                return current
            layout = layout or current.pipeline.layout  # the same, balanced anew
            self._check_layout(*layout)  # before the working ring is closed
            self.close_ring()
            self.scheduler = self._setup(*layout)
            return self.scheduler

    def ring_alive(self) -> bool:
        """As far as this end can tell (a worker restarted while idle closes the links; the next
        request sets up anew)."""
        tail = self.tail
        return tail is not None and tail.broken is None and tail.links.send_error is None \
            and tail.links.receiver.is_alive()

    def _check_layout(self, n_slots: int, context: int) -> None:
        if not 0 < n_slots <= MAX_SLOTS:
            raise GenerationError(f"{n_slots} samples at once: a ring holds 1..{MAX_SLOTS}")
        partition(self.cfg, self._shares(self.membership.planned()), n_slots, context,
                  compute_dtype(self.options.dtype).itemsize)

    def _shares(self, workers: Sequence[NodeSpec]) -> List[NodeSpec]:
        """The starter and ``workers`` with measured weights, and the last balancing step's ranges
        while the nodes are the same."""
        nodes = [self.options.spec] + list(workers)
        names, pins = self.pinned
        ours = pins if tuple(n.name for n in nodes) == names else {}
        return [dataclasses.replace(n, weight=self.measured.get(n.name, n.weight),
                                    layers=ours.get(n.name, n.layers)) for n in nodes]

    def _rebalance(self, current: Scheduler) -> bool:
        """Between requests: whether the measured times per block call for a step toward a new split
        (its ranges kept in ``pinned``, weights in ``measured``)."""
        margin = self.options.rebalance_margin
        if margin <= 0 or current.stats.messages < self._balanced_at + balance.MIN_MESSAGES:
            return False
        self._balanced_at = current.stats.messages
        stage = current.pipeline.stages[0]
        own = NodeStatus("starter", "starter", "ready", layers=stage.layers,
                         messages=stage.counters.messages, compute_s=stage.counters.compute_s)
        self.evidence = balance.observe(
            self.evidence, [own] + probe_all(self.members, defaults.DIAGNOSE_TIMEOUT_S), margin)
        weights = balance.measured_weights(
            self.evidence, {n.name: n.weight for n in self._shares(self.ring_workers)}, margin)
        if weights is None:
            return False
        step = balance_step(self, weights, current.pipeline.n_slots, current.pipeline.context)
        if step is None:
            return False
        self.measured = dict(self.measured, **weights)
        self.pinned = (tuple(p.name for p in step), {p.name: p.layers for p in step})
        log.info("re-splitting by measured speed %s: %s", {k: round(v, 2) for k, v in
                 weights.items()}, [f"{p.name} {block_range(p.layers)}" for p in step])
        return True

    def _setup(self, n_slots: int, context: int) -> Scheduler:
        was_lost = set(self.membership.lost)
        self.membership.refresh()
        pipeline, ends = self._build_surviving(n_slots, context, was_lost)
        chunk, rows = ring_message_rows(self.options, self.cfg)
        return Scheduler(pipeline, ends, chunk, self.options.timeout_s, max_rows=rows,
                         rebuild=functools.partial(self.rebuild, ring=self.rings)
                         if self.options.recover else None,
                         exit_layers=self.cfg.n_layers if self.early_exit is not None else 0,
                         compute=self.compute)

    def _build_surviving(self, n_slots: int, context: int, was_lost: Set[str]
                         ) -> Tuple[Pipeline, EmbedAndHead]:
        """``_build``, again without each worker lost meanwhile (a spare, else the survivors take
        its layers); a lost worker that answers but fails the set-up is left out again."""
        for _ in range(len(self.clients) + 1):
            try:
                return self._build(n_slots, context)
            except NodeLost as e:
                if not e.nodes or not self.options.recover:
                    raise
                self.recoveries += 1
                log.warning("recovering during set-up: %s", e)
                self.membership.lose(e.nodes, str(e))
            except (RingError, Conflict) as e:
                back = [c.node.name for c in self.members if c.node.name in was_lost]
                if not back:
                    raise
                log.warning("%s answered again but failed to rejoin: %s", ", ".join(back), e)
                self.membership.lose(back, f"failed to rejoin: {e}")
                was_lost = set()
        raise RingError(f"gave up setting up the ring after {len(self.clients) + 1} tries")

    def rebuild(self, lost: NodeLost, ring: int) -> Tuple[Pipeline, EmbedAndHead]:
        """The scheduler's recovery: a ring without the ``lost`` workers, same layout. A ring closed
        meanwhile (``ring`` no longer current) is not rebuilt: a RingError ends the loop."""
        while not self.setup_lock.acquire(timeout=defaults.WAIT_POLL_S):
            if self.rings != ring:
                raise RingError("the ring was closed while recovering")
        try:
            if self.scheduler is None or self.rings != ring or self.membership.closed.is_set():
                raise RingError("the starter was closed")
            self.recoveries += 1
            log.warning("recovering: %s", lost)
            if self.tail is not None:
                self.tail.close()
            self.membership.lose(lost.nodes, str(lost))
            pipeline = self.scheduler.pipeline
            return self._build(pipeline.n_slots, pipeline.context)
        finally:
            self.setup_lock.release()

    def _build(self, n_slots: int, context: int) -> Tuple[Pipeline, EmbedAndHead]:
        for client in self.members:  # end any ring these workers still serve for us
            self._call(client, "POST", "/reset", {}, timeout=10)
        self.placements = partition(self.cfg, self._shares(self.ring_workers), n_slots, context,
                                    compute_dtype(self.options.dtype).itemsize)
        self._balanced_at, self.evidence = 0, balance.Evidence()
        first = self.placements[0].layers
        stage = self.compute.call(self._stage, first, n_slots, context)
        last = len(self.members) - 1
        ports = [self._assign(client, placement.layers, n_slots, context, last=i == last)
                 for i, (client, placement) in enumerate(zip(self.members, self.placements[1:]))]
        self.tail = self._connect(ports)
        return Pipeline([stage], self.tail), EmbedAndHead(self.model)

    def _stage(self, first: Tuple[int, int], n_slots: int, context: int) -> LocalStage:
        """Loaded unless held already, on the compute thread."""
        if self.model is None or (self.model.first, self.model.last) != first:
            self.model = None
            torch_for = None if self.early_exit is None else "--early-exit"
            self.model = open_chunk(self.path, first, True, True, self.device,
                                    self.options.dtype, self.options.quantize or None, torch_for)
        return LocalStage(self.model, n_slots, context,
                          exit_policy=starter_policy(self.early_exit, self.hash, self.model))

    def _call(self, client: ControlClient, method: str, path: str, body: Any = None,
              what: str = "", **kwargs: Any) -> Any:
        """Under the stall rule (``SetupWatch``): a member that stops answering, or fails and does
        not answer, is lost."""
        step = f"{client.node.name}'s {method} {path.split('?')[0]}" + (f" ({what})" if what
                                                                          else "")
        try:
            return self.watch.run(step, [client], lambda: client.call(method, path, body,
                                                                      **kwargs))
        except NodeLost:
            raise
        except RingError as e:
            if client.status(timeout=defaults.DIAGNOSE_TIMEOUT_S).state == "down":
                raise NodeLost(f"worker {client.node.name!r} at {client.node.address}: {e}",
                               (client.node.name,)) from None
            raise

    def _assign(self, client: ControlClient, layers: Tuple[int, int], n_slots: int,
                context: int, last: bool) -> int:
        """Send the worker its tensors if it has no copy; its data port."""
        generation_config = {"bos_token_id": self.cfg.bos_id, "eos_token_id": list(self.cfg.eos_ids)}
        model = ModelRef(self.cfg.name, self.hash, config_to_hf(self.cfg), generation_config,
                         str(self.path.resolve()) if self.options.share_path else None)
        request = Assignment(model, layers, n_slots, context, self.options.dtype,
                             client.node.device, last, self.options.max_payload, self.session,
                             exit_assignment(self.early_exit), self.options.quantize)
        reply = AssignReply.from_json(self._call(client, "POST", "/assign", request.to_json(),
                                                 f"blocks {block_range(layers)}",
                                                 timeout=defaults.ASSIGN_TIMEOUT_S))
        if reply.need_weights:
            log.info("sending blocks %s to %s", block_range(layers), client.node.name)
            raw = sent_chunk(self.path, layers, request.early_exit)
            reply = AssignReply.from_json(self._call(
                client, "PUT", f"/weights?hash={self.hash}&session={self.session}&starter="
                f"{urllib.parse.quote(self.options.name)}",
                what=f"blocks {block_range(layers)}", raw=raw,
                timeout=defaults.ASSIGN_TIMEOUT_S))
        return reply.data_port

    def _connect(self, ports: List[int]) -> RingStages:
        """Each worker links to its successor (the last back to the starter), then the starter to
        the first. Handshakes are bound to a fresh ring tag; on failure every socket opened here is
        closed."""
        ring, workers = os.urandom(8).hex(), self.ring_workers
        ends = [self.route(w.host, port) for w, port in zip(workers, ports)] + \
            [self.route(self.options.host, int(self.listener.getsockname()[1]))]  # via route
        controls = [w.url for w in workers[1:]] + [self.options.control_url]
        codecs = [self.codecs[n.name] for n in workers + [self.options.spec]]
        for i, (client, control) in enumerate(zip(self.members, controls)):
            request = ConnectRequest(*ends[i + 1], control, ring=ring, codecs_in=str(codecs[i]),
                                     codecs_out=str(codecs[i + 1]))
            self._call(client, "POST", "/connect", request.to_json())
        cancel = threading.Event()
        links = self.watch.run(
            "the ring's links", self.members,
            lambda: starter_links(self, ends, bind(self.auth, ring), codecs, cancel),
            abandon=lambda late: late.close(timeout=0), cancel=cancel)
        return RingStages(links, self.members, self.options.timeout_s, self.options.stall_s)

    # ----------------------------------------------------------------- status and end

    def status(self) -> NodeStatus:
        return starter_status(self)

    def link_stats(self) -> List[Dict[str, Any]]:
        return ring_links(self.tail, self.ring_workers, self.members)

    def node_status(self) -> List[NodeStatus]:
        """Asked in parallel: a frozen worker costs one timeout, not one per node."""
        return self.membership.statuses()

    def close_ring(self) -> None:
        with self.setup_lock:
            self.rings += 1  # a recovery of the closed ring gives up
            if self.tail is not None:
                self.tail.close()
            self.tail, self.scheduler = None, None

    def close(self) -> None:
        """Release every worker in parallel, then stop listening."""
        self.membership.closed.set()
        self.close_ring()
        release_all(self.clients)
        close_quietly(self.listener)


def release_all(clients: Sequence[ControlClient]) -> None:
    """In parallel, each call bounded."""

    def release(client: ControlClient) -> None:
        try:
            client.call("POST", "/reset", {"release": True}, timeout=2)
        except RingError:
            pass

    threads = [threading.Thread(target=release, args=(c,), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3)


def balance_step(starter: RingStarter, weights: Dict[str, float], n_slots: int,
                 context: int) -> Optional[List[Placement]]:
    """One balancing step toward the split by ``weights`` (``balance.bounded_split``), or None when
    it moves nothing or does not fit declared memory."""
    nodes = [starter.options.spec] + starter.ring_workers  # as configured: their own pins
    aimed = [dataclasses.replace(n, weight=weights.get(n.name, n.weight)) for n in nodes]
    size = compute_dtype(starter.options.dtype).itemsize
    current = [p.layers[1] - p.layers[0] for p in starter.placements]
    try:
        target = [p.layers[1] - p.layers[0] for p in partition(starter.cfg, aimed, n_slots,
                                                                  context, size)]
        counts = balance.bounded_split(current, target, [n.layers is not None for n in nodes],
                                       balance.max_move(starter.cfg.n_layers))
        if counts == current:
            return None
        return partition(starter.cfg, [dataclasses.replace(n, layers=r) for n, r in
                                       zip(aimed, balance.ranges(counts))], n_slots, context, size)
    except PartitionError:  # the measured weights do not fit the declared memory
        return None


def starter_links(starter: RingStarter, ends: List[Tuple[str, int]], auth: Authenticator,
                  codecs: List[Compression], cancel: threading.Event) -> LinkPair:
    """Out to the first worker, in from the last; waiting stops when ``cancel`` is set."""
    first, last, options = starter.ring_workers[0], starter.ring_workers[-1], starter.options
    outbound = inbound = None
    try:
        outbound = connect_authenticated(*ends[0], auth,
                                         f"{first.name} ({ends[0][0]}:{ends[0][1]})",
                                         retry_s=defaults.LINK_RETRY_S,
                                         cancelled=cancel.is_set, codecs=codecs[0],
                                         seal=options.encrypt)
        inbound = accept_authenticated(starter.listener, auth, defaults.LINK_ACCEPT_TIMEOUT_S,
                                       "starter", cancelled=cancel.is_set, codecs=codecs[-1],
                                       seal=options.encrypt)
        return LinkPair(inbound, outbound, options.max_payload, "starter",
                        codecs[-1], codecs[0], busy_poll_us=options.busy_poll_us)
    except Exception as e:  # OSError, AuthError (a RingError) or anything else
        close_links(outbound, inbound)
        raise RingError(f"cannot close the ring (last worker {last.name!r}): {e}") from None


def starter_status(starter: RingStarter) -> NodeStatus:
    scheduler = starter.scheduler  # read once: another thread may set up a new ring
    stage = scheduler.pipeline.stages[0] if scheduler is not None else None
    url = starter.options.control_url
    status = NodeStatus(
        "starter", "starter", "idle", address=url.split("//", 1)[-1] if url
        else starter.options.host, version=__version__, model=starter.cfg.name,
        hash=starter.hash,
        device=starter.device, rss_bytes=rss_bytes(), max_rss_bytes=max_rss_bytes(),
        uptime_s=round(time.time() - starter.started, 1), pid=os.getpid(),
        link_rtt_ms=round_trip_ms((starter.ring_workers or starter.workers)[0].url),
        recoveries=starter.recoveries, threads=compute_threads(), code=running_code(),
        file_reads=reads())
    if scheduler is not None and stage is not None:
        status.state = "ready" if scheduler.idle else "busy"
        stage.describe(status, scheduler)
    if starter.tail is not None:
        status.links = starter.tail.links.stats()
    status.lost = sorted(dict(starter.membership.lost))
    status.setup = starter.watch.waiting()
    if starter.membership.degraded:
        status.state = "degraded"
        status.error = "serving without " + "; ".join(
            f"{name} ({why})" for name, why in dict(starter.membership.lost).items())
    return status


def ring_links(tail: Optional[RingStages], workers: List[NodeSpec],
               members: List[ControlClient]) -> List[Dict[str, Any]]:
    """Every link in ring order as its sender counts it; the workers' counts asked on their control
    ports."""
    if tail is None:
        return []
    names = ["starter"] + [w.name for w in workers] + ["starter"]
    outs = [tail.links.stats()["out"]] + [s.links.get("out", {}) for s in
                                          probe_all(members, defaults.DIAGNOSE_TIMEOUT_S)]
    return [dict({"from": a, "to": b}, **out) for a, b, out in zip(names, names[1:], outs)]
