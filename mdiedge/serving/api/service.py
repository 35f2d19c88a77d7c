"""Requests on an engine: each becomes a ``Generation`` submitted to the engine's one scheduler, set
up once with fixed KV slots and context (continuous batching; a request that does not fit waits in a
bounded queue, beyond it a 429 with ``Retry-After``).

A request is submitted before its handler answers, so the scheduler alone decides whether it is
taken. Its loop thread samples every token; tokens reach the HTTP handler through the request's own
asyncio queue, while a pool thread only waits for the end. A handler whose client went away cancels
its ``Generation``, freeing its KV rows on every node."""
from __future__ import annotations

import asyncio
import logging
import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, List, Optional, Set, Tuple, Union

from ...base import defaults
from ...base.errors import ApiError, ConfigError, ContextExceeded, GenerationError, QueueFull
from ...engine.engine import Engine, Prompt
from ...base.request import Request
from ...runtime.drafting import request_speculate
from ...runtime.generation import Generation
from ...runtime.plan import QueueView
from ...runtime.protocol import NodeStatus
from .errors import api_error
from .metrics import ApiMetrics
from .responses import Usage
from .rules import ServeLimits, retry_after_s, slot_context
from .sampling import check_vocab
from .schema import Options

log = logging.getLogger("mdiedge.api")
_DONE = object()


def _setting_up(waiting: str) -> ApiError:
    return ApiError(503, f"setting up the ring: waiting for {waiting}; try again later",
                    code="setting_up", retry_after=int(defaults.API_SETUP_WAIT_S))


class Run:
    """One request in flight. ``on_token`` and ``finish`` run on a stepping thread; the rest on the
    event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: ApiMetrics, stream: bool) -> None:
        self.loop, self.metrics, self.stream = loop, metrics, stream
        self.arrived = time.perf_counter()
        self.generation: Optional[Generation] = None
        self.task = 0  # this server's request number
        self.prompt_text = ""  # the prompt as the client gave it (text), or its ids' text
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
        if self.stream:  # the text a stream may show now, made here once
            assert self.generation is not None
            self._push((index, token, self.generation.samples[index].output.fresh()))

    def finish(self, error: Optional[BaseException]) -> None:
        self.error, self.finished = error, True
        self.metrics.e2e.observe(time.perf_counter() - self.arrived)
        if self.generation is not None and error is None:
            for sample in self.generation.samples:
                self.metrics.success.labels(sample.finish_reason or "none").inc()
        if self.generation is not None and self.generation.cached_tokens:
            self.metrics.cache_hits.inc()
            self.metrics.cached_tokens.inc(self.generation.cached_tokens)
        if self.generation is not None and self.generation.speculation is not None:
            self.metrics.speculated(self.generation.speculation.stats)
        self._push(_DONE)

    async def next(self, disconnected: Callable[[], Awaitable[bool]],
                   poll_s: float = 0.5) -> Optional[Tuple[int, int, str]]:
        """The next ``(sample index, token, text to stream)``, or None at the end; cancels the
        request once ``disconnected()``."""
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
        return Usage(len(samples[0].prompt), sum(len(s.tokens) for s in samples),
                     self.generation.cached_tokens)


class ApiService:
    """``name``: the model id, which requests may name differently unless ``strict_model_name``
    (then a 404)."""

    def __init__(self, engine: Engine, name: str, limits: ServeLimits,
                 strict_model_name: bool = False) -> None:
        from .chat import ChatTemplate

        context = slot_context(limits.context, engine.cfg.max_seq_len)
        if not 0 < context <= engine.cfg.max_seq_len:
            raise ConfigError(f"context: expected 1..{engine.cfg.max_seq_len} tokens (the "
                              f"model's), got {context}")
        self.answered = 0  # requests answered (any status)
        self.engine, self.name, self.limits, self.context = engine, name, limits, context
        self.strict_model_name = strict_model_name
        self.fingerprint = system_fingerprint(engine.path)
        self.created = int(time.time())
        self.template = ChatTemplate.for_model(engine.path, engine.tokenizer, context)
        engine.reserve(limits.slots, context)
        self.metrics = ApiMetrics()
        self.metrics.watch(lambda: self.counts()[0], lambda: self.counts()[1],
                           lambda: self.slots_in_use(), limits.slots, self.node_status)
        self.executor = ThreadPoolExecutor(limits.slots + limits.max_waiting,
                                           thread_name_prefix="mdiedge-api")
        self._runs: Set[Run] = set()
        self._lock = threading.Lock()
        self._mean_e2e_s = 1.0
        self._tasks = 0  # requests started (each run's ``task``: llama-server's id_task)
        self._scheduler: Optional[Any] = None  # the one the last request was submitted to
        self.closed = False

    # ----------------------------------------------------------------- state

    def queue(self) -> QueueView:
        """Nothing before the first request."""
        scheduler = self._scheduler
        return scheduler.queue() if scheduler is not None else QueueView(self.limits.slots, 0, 0)

    def counts(self) -> Tuple[int, int]:
        """Requests running (holding KV slots) and waiting."""
        view = self.queue()
        return view.running, view.waiting

    def slots_in_use(self) -> int:
        return self.queue().in_use

    def node_status(self) -> List[NodeStatus]:
        return self.engine.status()

    def unavailable(self) -> Optional[str]:
        """``/health``: None, or why not (no worker answers, shutting down)."""
        if self.closed:
            return "the server is shutting down"
        return self.engine.unavailable(defaults.DIAGNOSE_TIMEOUT_S)

    # ----------------------------------------------------------------- requests

    def plan(self, prompt: Union[str, Prompt], options: Options,
             templated: bool = False) -> Request:
        """The request taken in, tokenized once, its budget fitting a slot's context; a 404 for
        another model, a 400 for what this server cannot hold."""
        if options.model is not None and options.model != self.name and self.strict_model_name:
            raise ApiError(404, f"model {options.model!r} not found: this server serves "
                           f"{self.name!r}", "model", "model_not_found")
        if options.n > self.limits.slots:
            raise ApiError(400, f"n: at most {self.limits.slots} samples (the server's KV "
                           f"slots), got {options.n}", "n", "invalid_value")
        if isinstance(prompt, str):  # bounded before it is tokenized
            from .sandbox import Limits, check_fits

            try:
                check_fits("the prompt holds", len(prompt.encode("utf-8", "surrogatepass")),
                           Limits.for_context(self.context))
            except ContextExceeded as e:
                raise ApiError(400, str(e), "prompt", "context_length_exceeded") from None
        check_vocab(options.asked.params, self.engine.cfg.vocab_size)
        try:
            request_speculate(self.engine.speculate, options.speculate)
        except ConfigError as e:
            raise ApiError(400, str(e), "speculate", "invalid_value") from None
        try:
            return self.engine.request(prompt, options.asked, templated, self.context,
                                       self.limits.max_tokens, options.server_stops)
        except ContextExceeded as e:
            raise ApiError(400, str(e), "prompt" if options.asked.max_new_tokens is None
                           else options.max_tokens_key, "context_length_exceeded") from None
        except GenerationError as e:  # an empty prompt of a model with no BOS token
            raise ApiError(400, f"prompt: {e}", "prompt", "invalid_value") from None

    def running(self) -> List[Run]:
        """Oldest first."""
        with self._lock:
            return sorted(self._runs, key=lambda run: run.task)

    def activity(self) -> Tuple[int, int]:
        """Requests answered so far, and running now."""
        with self._lock:
            return self.answered, len(self._runs)

    def prompt_of(self, prompt: Union[str, Prompt, Tuple[int, ...]]) -> Union[str, Prompt]:
        """Token ids as a ``Prompt`` (a 400 for an id the model lacks); text as it is."""
        if not isinstance(prompt, tuple):
            return prompt
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is not in the model's vocabulary "
                           f"of {vocab}", "prompt", "invalid_value")
        return Prompt(self.engine.tokenizer.decode(list(prompt)), tuple(prompt))

    def tokenize(self, text: str, add_special: bool) -> List[int]:
        tokenizer = self.engine.tokenizer
        return list(tokenizer.encode_prompt(text) if add_special else tokenizer.encode(text))

    def grammar(self, options: Options) -> Any:
        """Compiled here, once; None without one."""
        if options.output is None:
            return None
        from ...model.grammar import Grammar, GrammarError

        kind, source, field = options.output
        try:
            return Grammar(self.engine.tokenizer, self.engine.cfg.vocab_size, kind, source)
        except GrammarError as e:
            if field == "tool_choice":  # implied, not asked for: the call is only asked for
                log.warning("tool_choice: a call cannot be enforced (%s); asking for it only", e)
                return None
            raise ApiError(400, f"{field}: {e}", field, "invalid_grammar") from None

    async def start(self, prompt: Union[str, Prompt], options: Options,
                    templated: bool = False) -> Run:
        """Check and submit (its end awaited on its own thread); a 429 when the queue refuses."""
        loop = asyncio.get_event_loop()
        if self.closed:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        run = Run(loop, self.metrics, options.stream)
        run.prompt_text = prompt if isinstance(prompt, str) else prompt.text
        with self._lock:
            self._tasks += 1
            run.task = self._tasks
        set_up_by = time.monotonic() + defaults.API_SETUP_WAIT_S
        await self._set_up_within(set_up_by)
        request = await loop.run_in_executor(None, self.plan, prompt, options, templated)
        run._last = [0.0] * options.n
        try:
            grammar = await loop.run_in_executor(None, self.grammar, options)
            run.generation = self.engine.generation_of(request, run.on_token, options.speculate)
            if grammar is not None:
                run.generation.constrain(grammar)
            run.generation.cache_prompt = options.cache_prompt
            if options.score_prompt:
                run.generation.score_prompt()
            if options.ignore_eos:
                run.generation.eos_ids = frozenset()
        except Exception as e:
            raise api_error(e) from None
        with self._lock:
            self._runs.add(run)
        try:
            scheduler = await self._submitted(loop, run, set_up_by)
        except BaseException as e:
            with self._lock:
                self._runs.discard(run)
            raise self._refusal(e) from None
        if scheduler is None:
            raise _setting_up(self.engine.setting_up() or "its set-up to end")
        self.metrics.prompt_tokens.inc(len(request.prompt.ids))
        self.executor.submit(self._work, run, scheduler)
        return run

    async def _set_up_within(self, deadline: float) -> None:
        """A 503 with Retry-After when a ring set-up is still under way at ``deadline``."""
        while True:
            waiting = self.engine.setting_up()
            if waiting is None:
                return
            if time.monotonic() >= deadline:
                raise _setting_up(waiting)
            await asyncio.sleep(defaults.API_SETUP_POLL_S)

    async def _submitted(self, loop: asyncio.AbstractEventLoop, run: Run,
                         deadline: float) -> Optional[Any]:
        """The scheduler ``run`` is submitted to (after a ring set-up if needed); None past
        ``deadline``: the request is cancelled (``_submitted_late`` ends it), the set-up goes on."""
        future = loop.run_in_executor(None, self._submit, run.generation)
        wait = max(defaults.API_SETUP_POLL_S, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait)
        except asyncio.TimeoutError:
            run.cancel()
            future.add_done_callback(lambda done: self._submitted_late(run, done))
            return None

    def _submitted_late(self, run: Run, done: "asyncio.Future[Any]") -> None:
        """A cancelled ``run`` submitted after its 503: run to its end (freeing what it holds), or
        forgotten if not taken."""
        if not done.cancelled() and done.exception() is None:
            try:
                self.executor.submit(self._work, run, done.result())
                return
            except RuntimeError:  # the server is closed: its engine ends the rest
                pass
        with self._lock:
            self._runs.discard(run)

    def _submit(self, generation: Generation) -> Any:
        scheduler = self._scheduler = self.engine.submit(generation,
                                                         max_waiting=self.limits.max_waiting)
        return scheduler

    def _refusal(self, error: BaseException) -> ApiError:
        if not isinstance(error, QueueFull):
            return api_error(error)
        return ApiError(429, str(error), code="queue_full", retry_after=retry_after_s(
            self._mean_e2e_s, self.queue().waiting, self.limits.slots))

    def _work(self, run: Run, scheduler: Any) -> None:
        error: Optional[BaseException] = None
        try:
            self.engine.run(run.generation, submitted=scheduler)
        except BaseException as e:  # the handler reports it; the server goes on
            error = e
        finally:
            with self._lock:
                self._runs.discard(run)
                self._mean_e2e_s = 0.8 * self._mean_e2e_s + 0.2 * (time.perf_counter() - run.arrived)
            run.finish(error)

    def close(self) -> None:
        """Cancel every request (their threads free their rows)."""
        self.closed = True
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            run.cancel()
        self.executor.shutdown(wait=False)


def system_fingerprint(model_path: Any) -> str:
    """The model file (or folder's files) by name, size and time, and this code's version."""
    from pathlib import Path

    from ... import __version__

    path = Path(model_path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256(__version__.encode())
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            continue
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return "fp_" + digest.hexdigest()[:12]
