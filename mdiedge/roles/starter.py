"""The starter node: tokenizer, embedding, its first blocks, the head and the sampler; it sets
up the ring over the control plane and drives generations around it.

Recurrent pipeline parallelism (MDI-LLM, Macario et al. 2024): with at least as many messages
in flight as nodes, every node is busy. A sample's prefill crosses the ring once with the whole
prompt (in several frames if it is long); each decode message then carries one token's
activation for a micro-batch of samples, each row with its own position and KV slot.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..runtime import framing
from ..base.accel import select
from ..model.checkpoint import chunk_safetensors, content_hash, load_config, load_model, resolve_model_path
from ..runtime.auth import Authenticator
from ..model.config import config_to_hf
from ..runtime.control import call, round_trip_ms
from .engine import Engine, GenerationOutput, parse_device, parse_dtype
from ..base.errors import RingError
from ..runtime.generation import Generation, Sample, Timing, TokenCallback
from ..runtime.partition import NodeShare, Placement, partition
from ..model.sampling import SamplingParams
from ..model.tokenizer import load_tokenizer
from ..runtime.links import (DEFAULT_MAX_PAYLOAD, LinkDown, Receiver, Sender, accept, close_quietly,
                        tcp_connect, tcp_listen)

log = logging.getLogger("mdiedge.starter")


@dataclass
class WorkerAddress:
    """Where a worker's control plane answers, and what it declares."""

    name: str
    host: str
    control_port: int
    weight: float = 1.0
    memory: Optional[int] = None
    layers: Optional[Tuple[int, int]] = None
    device: str = "cpu"
    data_port: int = 0  # learned from /assign

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.control_port}"


@dataclass
class RingStats:
    messages: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    per_node: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class _InFlight:
    kind: str  # "prefill", "decode" or "release"
    samples: List[Sample]
    final: bool = True  # the last frame of a prefill


class RingEngine(Engine):
    """Generation over a ring: this process is the starter, ``workers`` are running nodes."""

    def __init__(self, workers: Sequence[WorkerAddress], model: Optional[Union[str, Path]] = None,
                 tokenizer: Optional[Union[str, Path]] = None, device: str = "cpu",
                 dtype: str = "float32", host: str = "127.0.0.1", starter_weight: float = 1.0,
                 starter_memory: Optional[int] = None,
                 starter_layers: Optional[Tuple[int, int]] = None,
                 max_payload: int = DEFAULT_MAX_PAYLOAD, timeout_s: float = 60.0,
                 share_path: bool = True, secret: Optional[bytes] = None) -> None:
        self.path = resolve_model_path(model)
        self.cfg = load_config(self.path)
        self.tokenizer = load_tokenizer(self.path, tokenizer)
        self.workers = list(workers)
        self.device, self.dtype = str(parse_device(device)), dtype
        self.host, self.max_payload, self.timeout_s = host, max_payload, timeout_s
        self.share_path = share_path  # tell workers where the model lies (same filesystem)
        self.auth = Authenticator(secret)
        self.control_url: Optional[str] = None  # set when this starter serves a control plane
        self.started = time.time()
        self.session = os.urandom(8).hex()  # workers serve one starter session at a time
        self.starter_share = NodeShare("starter", starter_weight, starter_memory, starter_layers)
        self.hash = content_hash(self.path)
        self.model: Any = None
        self.placements: List[Placement] = []
        self.layout: Tuple[int, int, Tuple[Tuple[int, int], ...]] = (0, 0, ())
        self.listener = tcp_listen(host, 0)
        self.out_sock: Optional[socket.socket] = None
        self.in_sock: Optional[socket.socket] = None
        self.inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.sender: Optional[Sender] = None
        self.next_sample_id = 0
        self.seq = 0
        self.generating = False
        self.stats = RingStats()

    # ----------------------------------------------------------------- set-up

    def setup(self, n_slots: int, context: int) -> None:
        """Partition, load the starter's chunk, assign every worker, connect the ring. A ring
        already set up for at least ``n_slots`` x ``context`` is reused as it is."""
        if not self.workers:
            raise RingError("a ring needs at least one worker (use the local engine for one node)")
        have_slots, have_context, _ = self.layout
        if self.out_sock is not None and have_slots >= n_slots and have_context >= context:
            return
        self.close_links()
        for worker in self.workers:  # end any ring these workers still serve for us
            self._call(worker, "POST", "/reset", {}, timeout=10)
        shares = [self.starter_share] + [NodeShare(w.name, w.weight, w.memory, w.layers)
                                         for w in self.workers]
        itemsize = torch.empty(0, dtype=parse_dtype(self.dtype)).element_size()
        self.placements = partition(self.cfg, shares, n_slots, context, itemsize)
        first = self.placements[0].layers
        if self.model is None or (self.model.first, self.model.last) != first:
            self.model = load_model(self.path, layers=first, embedding=True, head=True,
                                    device=self.device, dtype=parse_dtype(self.dtype))
        self.model.setup_cache(n_slots, context)
        self.slots = select("slots").SlotTable(n_slots)
        for worker, placement in zip(self.workers, self.placements[1:]):
            self._assign(worker, placement.layers, n_slots, context,
                         last=worker is self.workers[-1])
        self._connect()
        self.layout = (n_slots, context, tuple(p.layers for p in self.placements))

    def _assign(self, worker: WorkerAddress, layers: Tuple[int, int], n_slots: int,
                context: int, last: bool) -> None:
        generation_config = {"bos_token_id": self.cfg.bos_id, "eos_token_id": list(self.cfg.eos_ids)}
        path = str(self.path.resolve()) if self.share_path else None
        body = {"model": {"name": self.cfg.name, "hash": self.hash, "path": path,
                          "config": config_to_hf(self.cfg), "generation_config": generation_config},
                "layers": list(layers), "n_slots": n_slots, "context": context,
                "dtype": self.dtype, "device": worker.device, "last": last,
                "max_payload": self.max_payload}
        reply = self._call(worker, "POST", "/assign", body, timeout=600)
        if reply.get("need_weights"):
            log.info("sending layers %s to %s", layers, worker.name)
            reply = self._call(worker, "PUT", f"/weights?hash={self.hash}&session={self.session}",
                               raw=chunk_safetensors(self.path, layers), timeout=600)
        worker.data_port = int(reply["data_port"])

    def _connect(self) -> None:
        """Each worker links to its successor (the last one to this starter), then the starter
        links to the first worker and accepts the last one's link."""
        successors = [(w.host, w.data_port, w.url) for w in self.workers[1:]]
        successors.append((self.host, int(self.listener.getsockname()[1]), self.control_url))
        for worker, (host, port, control) in zip(self.workers, successors):
            self._call(worker, "POST", "/connect",
                       {"next_host": host, "next_port": port, "next_control": control})
        first, last = self.workers[0], self.workers[-1]
        try:
            self.out_sock = tcp_connect(first.host, first.data_port)
            self.auth.connect_link(self.out_sock, f"{first.name} ({first.host}:{first.data_port})")
            self.in_sock = accept(self.listener, 30.0)
            self.auth.accept_link(self.in_sock, f"{last.name} ({last.host})")
        except OSError as e:
            raise RingError(f"cannot close the ring: {e}") from None
        self.inbox = queue.SimpleQueue()
        Receiver(self.in_sock, self.inbox, self.max_payload, "starter/recv").start()
        self.sender = Sender(self.out_sock, "starter/send")
        self.sender.start()

    def close_links(self) -> None:
        if self.sender is not None:
            self.sender.close(timeout=2)
            self.sender = None
        for sock in (self.out_sock, self.in_sock):
            close_quietly(sock)
        self.out_sock = self.in_sock = None

    def close(self) -> None:
        self.close_links()
        for worker in self.workers:
            try:
                self._call(worker, "POST", "/reset", {"release": True}, timeout=2)
            except RingError:
                pass
        close_quietly(self.listener)

    def _call(self, worker: WorkerAddress, method: str, path: str,
              body: Optional[Dict[str, Any]] = None, raw: Optional[bytes] = None,
              timeout: float = 30.0) -> Dict[str, Any]:
        if body is not None:
            body = dict(body, session=self.session)
        return call(worker.url, method, path, body, raw, timeout, worker.name, self.auth)

    # ----------------------------------------------------------------- generation

    def generate(self, prompt: str, max_new_tokens: int, n_samples: int = 1,
                 params: SamplingParams = SamplingParams(), micro_batch: int = 0,
                 on_token: Optional[TokenCallback] = None) -> GenerationOutput:
        generation = self.new_generation(prompt, max_new_tokens, n_samples, params, on_token)
        self.setup(n_samples, len(generation.samples[0].prompt) + max_new_tokens)
        timing = self.run(generation, micro_batch)
        return self.output(prompt, generation, timing)

    def group_size(self, n_samples: int, micro_batch: int) -> int:
        """Samples per decode message: as asked, else enough groups to keep every node busy."""
        if micro_batch > 0:
            return micro_batch
        return max(1, math.ceil(n_samples / (len(self.workers) + 1)))

    def run(self, generation: Generation, micro_batch: int = 0) -> Timing:
        samples = generation.samples
        ids = {s.index: self.next_sample_id + s.index for s in samples}
        self.next_sample_id = (self.next_sample_id + len(samples)) % (2 ** 32 - 1)
        chunk = max(1, self.max_payload // (self.cfg.dim * self.model.embed.weight.element_size()))
        size = min(self.group_size(len(samples), micro_batch), chunk)  # a frame holds a group
        groups = [samples[i:i + size] for i in range(0, len(samples), size)]
        group_of = {s.index: g for g, members in enumerate(groups) for s in members}
        inflight: Dict[int, _InFlight] = {}
        prefilled: set = set()
        started = time.perf_counter()
        compute_s = 0.0
        first_seq = self.seq
        self.generating = True
        try:
            t0 = time.perf_counter()
            for sample in samples:
                sample.slot = self.slots.allocate(ids[sample.index])
                for start in range(0, len(sample.prompt), chunk):
                    tokens = sample.prompt[start:start + chunk]
                    final = start + chunk >= len(sample.prompt)
                    seq = self._forward_and_send([sample], [tokens], [start], ids, prefill=True)
                    inflight[seq] = _InFlight("prefill", [sample], final)
            compute_s += time.perf_counter() - t0
            while inflight:
                header, hidden = self._receive()
                entry = inflight.pop(header.seq, None)
                if entry is None:
                    raise RingError(f"the ring returned an unknown message (seq {header.seq})")
                if entry.kind == "release" or not entry.final:
                    continue
                t0 = time.perf_counter()
                with torch.inference_mode():
                    logits = self.model.head_logits(hidden[:, -1].to(self.device))  # (B, vocab)
                generation.accept(entry.samples, logits)
                finished = [s for s in entry.samples if s.done]
                if finished:
                    for s in finished:
                        self.slots.free(ids[s.index])
                    self.seq += 1
                    self.sender.put((framing.RELEASE, 0, [ids[s.index] for s in finished],
                                     [0] * len(finished), None, self.seq))
                    inflight[self.seq] = _InFlight("release", [])
                if entry.kind == "prefill":
                    prefilled.add(entry.samples[0].index)
                    group = groups[group_of[entry.samples[0].index]]
                    ready = all(s.index in prefilled for s in group)
                    batch = [s for s in group if not s.done] if ready else []
                else:
                    batch = [s for s in entry.samples if not s.done]
                if batch:
                    seq = self._forward_and_send(batch, [[s.tokens[-1]] for s in batch],
                                                 [s.position for s in batch], ids, prefill=False)
                    inflight[seq] = _InFlight("decode", batch)
                compute_s += time.perf_counter() - t0
                if generation.timing.prefill_s == 0 and len(prefilled) == len(samples):
                    generation.timing.prefill_s = time.perf_counter() - started
        except BaseException:
            self.close_links()  # a half-finished ring cannot be reused
            raise
        finally:
            self.generating = False
        wall = time.perf_counter() - started
        sent = self.seq - first_seq
        self.stats.messages += sent
        self.stats.tokens += generation.timing.new_tokens
        self.stats.compute_s += compute_s
        self.stats.wall_s += wall
        generation.timing.decode_s = wall - generation.timing.prefill_s
        return generation.finish()

    def _forward_and_send(self, samples: List[Sample], tokens: List[List[int]],
                          positions: List[int], ids: Dict[int, int], prefill: bool) -> int:
        device = self.device
        with torch.inference_mode():
            x = self.model.embed_tokens(torch.tensor(tokens, device=device))  # (B, T, dim)
            x = self.model.run_blocks(x, torch.tensor([s.slot for s in samples], device=device),
                                      positions)
        if self.sender is None or self.sender.error:
            raise self._diagnose(self.sender.error if self.sender else "ring closed")
        self.seq += 1
        self.sender.put((framing.ACTIVATION, framing.FLAG_PREFILL if prefill else 0,
                         [ids[s.index] for s in samples], positions, x.to("cpu").contiguous(),
                         self.seq))
        return self.seq

    def ping(self, payload: torch.Tensor, count: int) -> List[float]:
        """Round-trip times (s) of ``count`` PING frames carrying ``payload`` around the ring:
        framing, queues and sockets with no compute."""
        times = []
        for _ in range(count):
            self.seq += 1
            t0 = time.perf_counter()
            self.sender.put((framing.PING, 0, [0], [0], payload, self.seq))
            header, _ = self._receive()
            times.append(time.perf_counter() - t0)
            if header.msg_type != framing.PING or header.seq != self.seq:
                raise RingError(f"unexpected reply to ping {self.seq}: type {header.msg_type}")
        return times

    def _receive(self) -> Tuple[Any, torch.Tensor]:
        try:
            item = self.inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            raise self._diagnose(f"no message returned within {self.timeout_s:.0f} s") from None
        if isinstance(item, LinkDown):
            raise self._diagnose(item.reason)
        return item

    def _diagnose(self, reason: str) -> RingError:
        """Name the node that broke the ring: the first worker whose control plane is gone."""
        for worker in self.workers:
            try:
                self._call(worker, "GET", "/status", timeout=2)
            except RingError as e:
                return RingError(f"worker {worker.name!r} at {worker.host}:{worker.control_port} "
                                 f"is down ({e}); ring link: {reason}")
        return RingError(f"the ring broke: {reason}")

    def own_status(self) -> Dict[str, Any]:
        from .. import __version__
        from .worker import rss_bytes

        model = self.model
        first = self.workers[0] if self.workers else None
        return {
            "role": "starter", "name": "starter", "version": __version__,
            "address": f"{self.host}:{self.control_url.rsplit(':', 1)[-1]}" if self.control_url
            else self.host,
            "state": "busy" if self.generating else ("ready" if self.out_sock else "idle"),
            "model": self.cfg.name, "hash": self.hash, "device": self.device,
            "layers": [model.first, model.last] if model is not None else None,
            "rss_bytes": rss_bytes(),
            "weight_bytes": model.parameter_bytes() if model is not None else 0,
            "kv_bytes": model.kv_cache_bytes() if model is not None else 0,
            "expert_load": model.expert_load() if model is not None else {},
            "slots_in_use": self.slots.in_use if model is not None else 0,
            "messages": self.stats.messages, "tokens": self.stats.tokens,
            "busy_fraction": round(self.stats.compute_s / self.stats.wall_s, 4)
            if self.stats.wall_s else 0.0,
            "link_rtt_ms": round_trip_ms(first.url) if first is not None else None,
            "uptime_s": round(time.time() - self.started, 1), "pid": os.getpid(),
        }

    def node_status(self) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        for worker in self.workers:
            try:
                status = self._call(worker, "GET", "/status", timeout=5)
            except RingError as e:
                status = {"role": "worker", "name": worker.name, "state": "down", "error": str(e)}
            status["address"] = f"{worker.host}:{worker.control_port}"
            out.append(status)
        return out
