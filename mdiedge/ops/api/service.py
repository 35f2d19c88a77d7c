"""Requests on an engine: each becomes a ``Generation`` submitted to the engine's one
scheduler, set up once with a fixed number of KV slots and context (continuous batching: a
request joins between steps when its samples fit the free slots, else it waits in a bounded
queue, and beyond that it is refused with a 429 and ``Retry-After``).

Each request's own thread steps the scheduler until that request is done (any number of
threads may, one steps at a time), so tokens are sampled on whichever thread steps; they reach
the request's HTTP handler through its own asyncio queue. A handler whose client went away
cancels its ``Generation``, which frees its KV rows on every node.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, List, Optional, Set, Tuple

from ...base import defaults
from ...base.errors import ApiError, ConfigError
from ...model.sampling import SamplingParams
from ...runtime.generation import Generation
from ...runtime.protocol import NodeStatus, busy_fraction
from .errors import api_error
from .metrics import ApiMetrics
from .responses import Usage
from .rules import ServeLimits, may_join, queue_state, retry_after_s, slot_context
from .schema import Options

_DONE = object()


class Run:
    """One request in flight: its generation, its tokens as they come (when streamed), its
    end. ``on_token`` and ``finish`` run on a stepping thread; the rest on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: ApiMetrics, stream: bool) -> None:
        self.loop, self.metrics, self.stream = loop, metrics, stream
        self.arrived = time.perf_counter()
        self.generation: Optional[Generation] = None
        self.error: Optional[BaseException] = None
        self.finished = False
        self._queue: "asyncio.Queue[Any]" = asyncio.Queue()
        self._last: List[float] = []
        self._first = True

    def _push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def on_token(self, index: int, token: int) -> None:
        now = time.perf_counter()
        if self._first:
            self._first = False
            self.metrics.ttft.observe(now - self.arrived)
        elif self._last[index]:
            self.metrics.itl.observe(now - self._last[index])
        self._last[index] = now
        self.metrics.generation_tokens.inc()
        if self.stream:
            self._push((index, token))

    def finish(self, error: Optional[BaseException]) -> None:
        self.error, self.finished = error, True
        self.metrics.e2e.observe(time.perf_counter() - self.arrived)
        if self.generation is not None and error is None:
            for sample in self.generation.samples:
                self.metrics.success.labels(sample.finish_reason or "none").inc()
        self._push(_DONE)

    async def next(self, disconnected: Callable[[], Awaitable[bool]],
                   poll_s: float = 0.5) -> Optional[Tuple[int, int]]:
        """The next ``(sample index, token)``, or None at the end; cancels the request when
        ``disconnected()`` says the client is gone."""
        while True:
            try:
                item = self._queue.get_nowait() if not self._queue.empty() else \
                    await asyncio.wait_for(self._queue.get(), poll_s)
            except asyncio.TimeoutError:
                if not self.finished and await disconnected():
                    self.cancel()
                continue
            return None if item is _DONE else item

    def cancel(self) -> None:
        if self.generation is not None and not self.finished:
            self.generation.cancel()

    @property
    def admitted(self) -> bool:
        return self.generation is not None and bool(self.generation.admitted_at)

    def usage(self) -> Usage:
        assert self.generation is not None
        samples = self.generation.samples
        return Usage(len(samples[0].prompt), sum(len(s.tokens) for s in samples))


class ApiService:
    """Runs the API's requests on ``engine`` with ``limits``; ``name``: the model id."""

    def __init__(self, engine: Any, name: str, limits: ServeLimits) -> None:
        from .chat import ChatTemplate

        context = slot_context(limits.context, engine.cfg.max_seq_len)
        if not 0 < context <= engine.cfg.max_seq_len:
            raise ConfigError(f"context: expected 1..{engine.cfg.max_seq_len} tokens (the "
                              f"model's), got {context}")
        self.engine, self.name, self.limits, self.context = engine, name, limits, context
        self.created = int(time.time())
        self.template = ChatTemplate.for_model(engine.path, engine.tokenizer)
        engine.reserve(limits.slots, context)
        self.metrics = ApiMetrics()
        self.metrics.watch(lambda: self.counts()[0], lambda: self.counts()[1],
                           lambda: self.slots_in_use(), limits.slots, self.node_status)
        self.executor = ThreadPoolExecutor(limits.slots + limits.max_waiting,
                                           thread_name_prefix="mdiedge-api")
        self._runs: Set[Run] = set()
        self._lock = threading.Lock()
        self._mean_e2e_s = 1.0
        self.closed = False

    # ----------------------------------------------------------------- state

    def counts(self) -> Tuple[int, int]:
        """Requests running (holding KV slots) and waiting for them."""
        with self._lock:
            runs = list(self._runs)
            waiting = self._queue()[1]
        return sum(1 for r in runs if r.admitted), waiting

    def _queue(self) -> Tuple[int, int]:
        """(KV slots taken, requests waiting) of the requests not yet ended, in the order they
        came; the caller holds the lock. A request that fits counts as taking its slots
        before the scheduler admits it: it is not waiting for slots."""
        sizes = [len(r.generation.samples) for r in sorted(self._runs, key=lambda r: r.arrived)
                 if r.generation is not None and not (r.admitted and r.generation.settled)]
        return queue_state(sizes, self.limits.slots)

    def slots_in_use(self) -> int:
        with self._lock:
            runs = list(self._runs)
        return sum(len(r.generation.samples) for r in runs
                   if r.admitted and r.generation is not None and not r.generation.settled)

    def node_status(self) -> List[NodeStatus]:
        """The starter's and each worker's status (a ring), or this process as one node."""
        starter = getattr(self.engine, "starter", None)
        if starter is not None:
            return [starter.status()] + starter.node_status()
        scheduler = getattr(self.engine, "scheduler", None)
        busy = 0.0 if scheduler is None else busy_fraction(
            scheduler.stats.compute_s, time.time() - scheduler.pipeline.stages[0].counters.since)
        return [NodeStatus("starter", "local", "busy" if self.counts()[0] else "ready",
                           layers=[0, self.engine.cfg.n_layers], busy_fraction=busy,
                           slots_in_use=self.slots_in_use())]

    def unavailable(self) -> Optional[str]:
        """None when the engine can take a request, else why not, in one line (``/health``):
        a ring none of whose workers answers, or a server shutting down."""
        if self.closed:
            return "the server is shutting down"
        return self.engine.unavailable(defaults.DIAGNOSE_TIMEOUT_S)

    # ----------------------------------------------------------------- requests

    def plan(self, prompt: str, options: Options,
             templated: bool = False) -> Tuple[List[int], int, SamplingParams]:
        """The prompt's ids, the token budget and the sampling of a request; a 404 for another
        model, a 400 for what this server cannot hold; ``templated``: a chat template's text."""
        if options.model is not None and options.model != self.name:
            raise ApiError(404, f"model {options.model!r} not found: this server serves "
                           f"{self.name!r}", "model", "model_not_found")
        if options.n > self.limits.slots:
            raise ApiError(400, f"n: at most {self.limits.slots} samples (the server's KV "
                           f"slots), got {options.n}", "n", "invalid_value")
        ids = self.engine.encode_prompt(prompt, templated)
        if not ids:
            raise ApiError(400, "prompt: empty, and the model has no BOS token to start from",
                           "prompt", "invalid_value")
        budget = options.max_tokens
        if budget is None and len(ids) >= self.context:
            raise ApiError(400, f"prompt of {len(ids)} tokens leaves no room for a new one in "
                           f"the context of {self.context} tokens", "prompt",
                           "context_length_exceeded")
        if budget is None:
            budget = min(self.limits.max_tokens, self.context - len(ids))
        if budget < 1 or len(ids) + budget > self.context:
            key = options.max_tokens_key
            raise ApiError(400, f"prompt of {len(ids)} tokens plus {key} {budget} exceeds "
                           f"the context of {self.context} tokens", key,
                           "context_length_exceeded")
        seed = options.seed if options.seed is not None else defaults.random_seed()
        params = SamplingParams(
            defaults.TEMPERATURE if options.temperature is None else options.temperature,
            defaults.TOP_K if options.top_k is None else options.top_k,
            defaults.TOP_P if options.top_p is None else options.top_p, seed)
        return ids, budget, params

    async def start(self, prompt: str, options: Options, templated: bool = False) -> Run:
        """Check and start a request (on its own thread); a 429 when the queue is full."""
        loop = asyncio.get_event_loop()
        if self.closed:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        run = Run(loop, self.metrics, options.stream)
        ids, budget, params = await loop.run_in_executor(None, self.plan, prompt, options,
                                                         templated)
        with self._lock:
            taken, waiting = self._queue()
            if not may_join(waiting, self.limits.slots - taken, options.n,
                            self.limits.max_waiting):
                raise ApiError(429, f"{waiting} requests are waiting for the "
                               f"{self.limits.slots} KV slots already; try again later",
                               code="queue_full", retry_after=retry_after_s(
                                   self._mean_e2e_s, waiting, self.limits.slots))
            run._last = [0.0] * options.n
            try:
                run.generation = self.engine.new_generation(prompt, budget, options.n, params,
                                                            run.on_token, options.stop, templated)
            except Exception as e:
                raise api_error(e) from None
            self._runs.add(run)
        self.metrics.prompt_tokens.inc(len(ids))
        self.executor.submit(self._work, run)
        return run

    def _work(self, run: Run) -> None:
        error: Optional[BaseException] = None
        try:
            self.engine.run(run.generation)
        except BaseException as e:  # the handler reports it; the server goes on
            error = e
        finally:
            with self._lock:
                self._runs.discard(run)
                self._mean_e2e_s = 0.8 * self._mean_e2e_s + 0.2 * (time.perf_counter() - run.arrived)
            run.finish(error)

    def close(self) -> None:
        """Cancel every request (their threads free their rows and end)."""
        self.closed = True
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            run.cancel()
        self.executor.shutdown(wait=False)
