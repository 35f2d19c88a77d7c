"""From a prompt string to sampled text: the tokenizer, the scheduler and a pipeline to run
the blocks. ``LocalEngine`` builds a pipeline of in-process stages (``--nodes 1`` is one);
``RingEngine`` (``mdiedge.roles.starter``) builds the starter's stage plus the ring.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..base import defaults
from ..base.errors import MdiedgeError
from ..base.defaults import SHOWN_SETUP_S
from ..base.words import plural
from ..model.checkpoint import check_checkpoint, content_hash, load_config, load_model, \
    resolve_model_path
from ..model.fit import check_tokenizer
from ..model.exitfiles import ExitSettings
from ..model.config import ModelConfig
from ..model.devices import parse_device, parse_dtype
from ..model.sampling import SamplingParams
from ..model.tokenizer import Tokenizer, decode_continuation, load_tokenizer
from ..model.stopping import StopMatcher, check_stops, cut_at_stop
from ..runtime.generation import (ExitCounts, Generation, Recovery, Sample, Timing,
                                  TokenCallback)
from ..runtime.partition import split_layers
from ..runtime.pipeline import ModelEnds, Pipeline
from ..runtime.scheduler import Scheduler
from ..runtime.stages import LocalStage
from .exitparts import starter_policy

PathLike = Union[str, Path]

log = logging.getLogger("mdiedge.engine")
log.addHandler(logging.NullHandler())  # a command that configures no logging prints none of it
_requests = itertools.count(1)  # this process's generations, numbered for the log


def _shape(generation: Generation) -> str:
    n, p = len(generation.samples), len(generation.samples[0].prompt)
    return f"{plural(n, 'sample')}, prompt {plural(p, 'token')}"


def summary_line(request: int, generation: Generation, timing: Timing) -> str:
    """The log line of a finished generation: its size, speed and how its samples ended."""
    reasons = Counter(s.finish_reason or "unfinished" for s in generation.samples)
    ends = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
    return (f"generation {request}: {_shape(generation)}, {timing_text(timing)}; "
            f"finished: {ends}")


def timing_text(timing: Timing) -> str:
    """``7 new tokens in 0.61 s (11.5 tok/s), set-up 3.07 s``: tokens/s over the generation
    alone; the set-up (a ring set up for this request) named apart when there was one."""
    text = (f"{plural(timing.new_tokens, 'new token')} in {timing.generation_s:.2f} s "
            f"({timing.tokens_per_s:.1f} tok/s)")
    return text + (f", set-up {timing.setup_s:.2f} s" if timing.setup_s >= SHOWN_SETUP_S else "")


def failure_line(request: int, generation: Generation, error: BaseException) -> str:
    """The log line of a generation that failed (or was interrupted), and why."""
    produced = sum(len(s.tokens) for s in generation.samples)
    detail = " ".join(str(error).split())
    reason = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    return (f"generation {request} failed after {time.perf_counter() - generation.started:.2f} "
            f"s ({_shape(generation)}, {plural(produced, 'new token')}): {reason}")


@dataclass
class GenerationOutput:
    prompt: str
    prompt_ids: List[int]
    samples: List[Dict[str, Any]]
    timing: Timing
    recoveries: List[Recovery] = field(default_factory=list)
    early_exit: Optional[Dict[str, Any]] = None  # criterion, exit rates, layers per token

    def as_dict(self) -> Dict[str, Any]:
        out = {"prompt": self.prompt, "prompt_tokens": len(self.prompt_ids),
               "samples": self.samples, "timing": self.timing.as_dict(),
               "recoveries": [r.as_dict() for r in self.recoveries]}
        if self.early_exit is not None:
            out["early_exit"] = self.early_exit
        return out


class TextModel:
    """A model's text side, no weights: its config and tokenizer, prompts to token ids, and
    sampled ids back to text. Checks a request before anything heavy starts."""

    path: Path
    cfg: ModelConfig
    tokenizer: Tokenizer
    holds_weights = False  # an engine's (below) are checked against its config at once

    def __init__(self, model: Optional[PathLike] = None,
                 tokenizer: Optional[PathLike] = None) -> None:
        self._open(model, tokenizer)

    def _open(self, model: Optional[PathLike], tokenizer: Optional[PathLike]) -> None:
        self.path = resolve_model_path(model)
        self.cfg = load_config(self.path)
        if self.holds_weights:  # the config against the weights, before any node builds
            check_checkpoint(self.path, self.cfg)
        self.tokenizer = load_tokenizer(self.path, tokenizer)
        check_tokenizer(self.cfg, self.tokenizer, tokenizer or self.path)

    def encode_prompt(self, prompt: str, templated: bool = False) -> List[int]:
        """A prompt's ids, with the special tokens its tokenizer adds (the rule of
        ``mdiedge.model.tokenizer``); ``templated``: a chat template's text, which holds its
        own special tokens, so nothing is added (as transformers' ``apply_chat_template``).
        An empty prompt starts from the BOS token alone."""
        tokenizer = self.tokenizer
        ids = tokenizer.encode(prompt) if templated else tokenizer.encode_prompt(prompt)
        if not ids:
            start = tokenizer.bos_id if tokenizer.bos_id is not None else self.cfg.bos_id
            ids = [start] if start is not None else []
        return ids

    def new_generation(self, prompt: str, max_new_tokens: int, n_samples: int,
                       params: SamplingParams, on_token: Optional[TokenCallback],
                       stop: Sequence[str] = (), templated: bool = False) -> Generation:
        """A request's ``Generation``; ``stop``: strings that end a sample (checked here, so
        a bad one is an error before anything runs); ``templated``: see ``encode_prompt``."""
        stops = check_stops(stop)
        factory = None
        if stops:
            def factory(prefix: Sequence[int]) -> StopMatcher:
                return StopMatcher(stops, self.tokenizer, prefix)
        return Generation(self.encode_prompt(prompt, templated), n_samples, max_new_tokens, params,
                          self.cfg.eos_ids, self.cfg.max_seq_len, on_token, factory)

    def sample_text(self, sample: Sample) -> str:
        """A sample's text after its prompt, up to its stop string if it stopped on one."""
        text = decode_continuation(self.tokenizer, sample.prompt, sample.tokens)
        if sample.finish_reason == "stop" and sample.stop is not None:
            text = cut_at_stop(text, sample.stop.stops)[0]
        return text

    def output(self, prompt: str, generation: Generation, timing: Timing) -> GenerationOutput:
        samples = [{"index": s.index, "text": self.sample_text(s),
                    "token_ids": s.tokens, "finish_reason": s.finish_reason}
                   for s in generation.samples]
        early_exit = None
        settings: Optional[ExitSettings] = getattr(self, "early_exit", None)
        if settings is not None:
            counts = generation.exits or ExitCounts(self.cfg.n_layers)
            early_exit = dict(criterion=settings.criterion, **counts.as_dict())
        return GenerationOutput(prompt, generation.samples[0].prompt, samples, timing,
                                generation.recoveries, early_exit)


class Engine(TextModel):
    """What both engines share: a generation run by the scheduler that ``prepare`` gives."""

    holds_weights = True

    _setup_lock: threading.Lock
    reserved: Tuple[int, int] = (0, 0)  # the least (slots, context) of any set-up

    def reserve(self, n_slots: int, context: int) -> None:
        """Set every later pipeline up with at least ``n_slots`` x ``context`` (a server's
        fixed layout: its requests share one pipeline and never make it resize)."""
        self.reserved = (n_slots, context)

    def prepare(self, n_slots: int, context: int) -> Scheduler:
        """A scheduler whose pipeline holds ``n_slots`` samples of ``context`` tokens (the
        caller holds ``_setup_lock``, or knows no other thread uses the engine)."""
        raise NotImplementedError

    def unavailable(self, timeout: float) -> Optional[str]:
        """None when the engine can take a request, else why not, in one line; ``timeout``:
        how long a ring may ask its nodes. A process of its own always can."""
        return None

    def submit(self, generation: Generation, micro_batch: int = 0) -> Scheduler:
        """Queue ``generation`` on a pipeline that holds it; that pipeline's scheduler. Set-up
        and submission are one step, so no other request's set-up replaces the pipeline
        between them."""
        with self._setup_lock:
            scheduler = self.prepare(max(len(generation.samples), self.reserved[0]),
                                     max(generation.context, self.reserved[1]))
            generation.mark_set_up()
            scheduler.submit(generation, micro_batch)
        return scheduler

    def run(self, generation: Generation, micro_batch: int = 0) -> Timing:
        """Run ``generation`` to its end; one log line says how it went (INFO when it
        finished, WARNING when it failed or was interrupted)."""
        request = next(_requests)
        try:
            scheduler = self.submit(generation, micro_batch)
            filled = self.kv_fill_s()  # the pipeline it runs on is set up now
            timing = scheduler.wait(generation)
            if generation.exits is not None:  # the nodes' fill time meanwhile
                generation.exits.kv_fill_s = max(0.0, self.kv_fill_s() - filled)
        except BaseException as e:
            log.warning("%s", failure_line(request, generation, e))
            raise
        log.info("%s", summary_line(request, generation, timing))
        return timing

    def generate(self, prompt: str, max_new_tokens: int = defaults.MAX_NEW_TOKENS,
                 n_samples: int = 1, params: SamplingParams = SamplingParams(),
                 micro_batch: int = 0, on_token: Optional[TokenCallback] = None,
                 stop: Sequence[str] = (), templated: bool = False) -> GenerationOutput:
        try:
            generation = self.new_generation(prompt, max_new_tokens, n_samples, params,
                                             on_token, stop, templated)
        except MdiedgeError as e:  # e.g. a prompt beyond the context: one line, then the error
            log.warning("generation refused: %s", " ".join(str(e).split()))
            raise
        timing = self.run(generation, micro_batch)
        return self.output(prompt, generation, timing)

    def kv_fill_s(self) -> float:
        """Seconds the nodes spent filling the KV of blocks that early exits skipped."""
        return 0.0

    def close(self) -> None:
        """Release what the engine holds (nodes, links); a local engine holds nothing."""


class LocalEngine(Engine):
    """Every block in this process, split over ``stages`` in-process stages in the ring's
    proportions (one stage: the plain single-process engine)."""

    def __init__(self, model: Optional[PathLike] = None, tokenizer: Optional[PathLike] = None,
                 device: str = "cpu", dtype: str = "float32", stages: int = 1,
                 prefill_chunk: int = 0, early_exit: Optional[ExitSettings] = None,
                 quantize: str = "") -> None:
        self._open(model, tokenizer)
        self.early_exit = early_exit
        self.device, self.dtype = str(parse_device(device)), parse_dtype(dtype)
        self.ranges = split_layers(self.cfg.n_layers, [1.0] * stages) if stages > 1 \
            else [(0, self.cfg.n_layers)]
        self.chunks = [load_model(self.path, layers=r, embedding=i == 0, head=i == 0,
                                  device=self.device, dtype=self.dtype,
                                  quantize=quantize or None)
                       for i, r in enumerate(self.ranges)]
        self.model = self.chunks[0]  # the embedding, the first blocks and the head
        self.exit_policy = starter_policy(early_exit, content_hash(self.path), self.model)
        self.prefill_chunk = prefill_chunk
        self.scheduler: Optional[Scheduler] = None
        self._setup_lock = threading.Lock()

    def prepare(self, n_slots: int, context: int) -> Scheduler:
        current = self.scheduler
        if current is not None and (not current.usable or current.idle and (
                current.pipeline.n_slots < n_slots or current.pipeline.context < context)):
            current = None  # broken, or too small with nothing running: set up anew
        if current is None:
            last = len(self.chunks) - 1
            stages = [LocalStage(chunk, n_slots, context, trim_prefill=i == last,
                                 exit_policy=self.exit_policy)
                      for i, chunk in enumerate(self.chunks)]
            current = self.scheduler = Scheduler(
                Pipeline(stages), ModelEnds(self.model), self.prefill_chunk,
                exit_layers=self.cfg.n_layers if self.exit_policy is not None else 0)
        return current

    @property
    def stages(self) -> Sequence[LocalStage]:
        return self.scheduler.pipeline.stages if self.scheduler is not None else []

    def kv_fill_s(self) -> float:
        return sum(stage.counters.kv_fill_s for stage in self.stages)
