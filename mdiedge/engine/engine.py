"""From a prompt string to sampled text: the tokenizer, the scheduler and a pipeline. A request is
taken in once (``TextModel.request``): tokenized into a ``Prompt`` and every limit checked, into a
``Request`` its ``Generation`` is built from without checking again."""
from __future__ import annotations

import abc
import itertools
import logging
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..base import defaults
from ..base.errors import MdiedgeError
from ..base.memory import give_back_free_memory
from ..base.defaults import SHOWN_SETUP_S
from ..base.humanize import plural
from ..model.hub import resolve_model
from ..model.modelfile import ModelFile, model_file
from ..model.config import ModelConfig
from ..model.tokenizer import Tokenizer, load_tokenizer
from ..base.request import Asked, Prompt, Request, SamplingParams, take_request
from ..model.stopping import TextOutput
from ..runtime.generation import ExitCounts, Generation, Recovery, Timing, TokenCallback
from ..runtime.protocol import NodeStatus
from ..runtime.compute import ComputeThread
from ..runtime.drafting import parse_speculate, request_speculate
from ..runtime.scheduler import Scheduler

TYPE_CHECKING = False
if TYPE_CHECKING:  # early exit and a draft model run on the torch path
    from ..model.earlyexit.files import ExitSettings
    from ..runtime.draftmodel import DraftModel

PathLike = Union[str, Path]

log = logging.getLogger("mdiedge.engine")
log.addHandler(logging.NullHandler())  # a command that configures no logging prints none of it
_requests = itertools.count(1)  # this process's generations, numbered for the log


def _shape(generation: Generation) -> str:
    n, p = len(generation.samples), len(generation.samples[0].prompt)
    return f"{plural(n, 'sample')}, prompt {plural(p, 'token')}"


def summary_line(request: int, generation: Generation, timing: Timing) -> str:
    reasons = Counter(s.finish_reason or "unfinished" for s in generation.samples)
    ends = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
    return (f"generation {request}: {_shape(generation)}, {timing_text(timing)}; "
            f"finished: {ends}")


def timing_text(timing: Timing) -> str:
    """``7 new tokens in 0.61 s (11.5 tok/s), set-up 3.07 s``: tokens/s over the generation alone.
    """
    text = (f"{plural(timing.new_tokens, 'new token')} in {timing.generation_s:.2f} s "
            f"({timing.tokens_per_s:.1f} tok/s)")
    return text + (f", set-up {timing.setup_s:.2f} s" if timing.setup_s >= SHOWN_SETUP_S else "")


def failure_line(request: int, generation: Generation, error: BaseException) -> str:
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
    speculation: Optional[Dict[str, Any]] = None  # drafted, accepted, k histogram

    def as_dict(self) -> Dict[str, Any]:
        out = {"prompt": self.prompt, "prompt_tokens": len(self.prompt_ids),
               "samples": self.samples, "timing": self.timing.as_dict(),
               "recoveries": [r.as_dict() for r in self.recoveries]}
        if self.early_exit is not None:
            out["early_exit"] = self.early_exit
        if self.speculation is not None:
            out["speculation"] = self.speculation
        return out


class TextModel:
    """A model's text side, no weights: config, tokenizer, prompts to ids and ids to text."""

    path: Path
    file: ModelFile  # the model's files as this process reads them, opened once
    cfg: ModelConfig
    tokenizer: Tokenizer
    holds_weights = False  # an engine's (below) are checked against its config at once

    def __init__(self, model: Optional[PathLike] = None,
                 tokenizer: Optional[PathLike] = None) -> None:
        self._open(model, tokenizer)

    def _open(self, model: Optional[PathLike], tokenizer: Optional[PathLike],
              text: Optional["TextModel"] = None) -> None:
        """``text``: a text side opened already (weights checked against its config), taken as it
        is."""
        if text is not None:
            self.path, self.file, self.cfg = text.path, text.file, text.cfg
            self.tokenizer = text.tokenizer
            return
        from ..model.cpuload import check_checkpoint
        from ..model.checks import check_tokenizer

        self.path = resolve_model(model)
        self.file = model_file(self.path)
        self.cfg = self.file.cfg
        if self.holds_weights:  # the config against the weights, before any node builds
            check_checkpoint(self.path, self.cfg)
        self.tokenizer = load_tokenizer(self.path, tokenizer)
        check_tokenizer(self.cfg, self.tokenizer, tokenizer or self.path)
        give_back_free_memory()  # the vocabulary's strings, read to build the tokenizer

    def encode_prompt(self, prompt: str, templated: bool = False) -> List[int]:
        """With the special tokens its tokenizer adds; ``templated``: a chat template's text holds
        its own, so nothing is added (as ``apply_chat_template``). An empty prompt starts from BOS
        alone."""
        tokenizer = self.tokenizer
        ids = tokenizer.encode(prompt) if templated else tokenizer.encode_prompt(prompt)
        if not ids:
            start = tokenizer.bos_id if tokenizer.bos_id is not None else self.cfg.bos_id
            ids = [start] if start is not None else []
        return ids

    def prompt(self, text: Union[str, Prompt], templated: bool = False) -> Prompt:
        if isinstance(text, Prompt):
            return text
        return Prompt(text, tuple(self.encode_prompt(text, templated)))

    def request(self, prompt: Union[str, Prompt], asked: Asked, templated: bool = False,
                context: int = 0, default_budget: int = 0,
                server_stops: Sequence[str] = ()) -> Request:
        """Tokenized (a ``Prompt`` as it is) and its budget fitted to ``context`` (0: the model's).
        """
        return take_request(self.prompt(prompt, templated), asked,
                            context or self.cfg.max_seq_len, default_budget, server_stops)

    def new_generation(self, prompt: Union[str, Prompt], max_new_tokens: int, n_samples: int,
                       params: SamplingParams, on_token: Optional[TokenCallback] = None,
                       stop: Sequence[str] = (), templated: bool = False) -> Generation:
        return self.generation_of(self.request(prompt, Asked(max_new_tokens, n_samples, params,
                                                             stop), templated), on_token)

    def generation_of(self, request: Request,
                      on_token: Optional[TokenCallback] = None) -> Generation:
        """Each sample's text put out by a ``TextOutput`` of its own."""
        def output(prefix: Sequence[int]) -> TextOutput:
            return TextOutput(self.tokenizer, prefix, list(request.stop))
        return Generation(request, self.cfg.eos_ids, on_token, output)

    def output(self, prompt: Union[str, Prompt], generation: Generation,
               timing: Timing) -> GenerationOutput:
        samples = [{"index": s.index, "text": s.text,
                    "token_ids": s.tokens, "finish_reason": s.finish_reason}
                   for s in generation.samples]
        early_exit = None
        settings: Optional[ExitSettings] = getattr(self, "early_exit", None)
        if settings is not None:
            counts = generation.exits or ExitCounts(self.cfg.n_layers)
            early_exit = dict(criterion=settings.criterion, **counts.as_dict())
        text = prompt.text if isinstance(prompt, Prompt) else prompt
        speculation = generation.speculation
        return GenerationOutput(text, generation.samples[0].prompt, samples, timing,
                                generation.recoveries, early_exit,
                                None if speculation is None else speculation.stats.as_dict())


class Engine(TextModel, abc.ABC):
    """What the CLI, the API and the tools generate with (``open_engine``): ``LocalEngine`` or
    ``RingEngine``, and no caller needs to know which."""

    holds_weights = True

    _setup_lock: threading.Lock
    compute: ComputeThread  # this process's torch work: loading, set-up, stepping
    reserved: Tuple[int, int] = (0, 0)  # the least (slots, context) of any set-up
    _closers: Optional[ExitStack] = None
    speculate: Optional[str] = None  # every request's drafter (``drafter_for``); None: off
    speculate_device: str = "cpu"  # where a draft model runs
    draft_model: Optional[DraftModel] = None  # ``draft:PATH``'s model, shared by requests
    prompt_cache = False  # finished requests' KV rows kept for prompts that continue them

    def speculating(self, drafter: Optional[str], device: str = "cpu") -> None:
        """``drafter``: ``ngram``, ``draft:PATH``; None or ``off``: none. A draft model is loaded
        once, on the compute thread."""
        self.speculate = None if drafter in (None, "off") else drafter
        self.speculate_device = device
        self.draft_model = None
        if self.speculate is not None:
            kind, path = parse_speculate(self.speculate)
            if kind == "draft":
                from ..runtime.draftmodel import DraftModel

                self.draft_model = self.compute.call(DraftModel.load, path, self.cfg,
                                                     *self.reserved, device)

    def speculation_for(self, generation: Generation,
                        speculate: Optional[str] = None) -> Optional[Any]:
        """None, or the request's ``Speculation`` (``speculate`` None: the engine's choice); a draft
        model's drafter holds the request's own slots of the shared ``draft_model``."""
        chosen = request_speculate(self.speculate, speculate)
        if chosen is None:
            return None
        from ..runtime.speculation import Speculation, drafter_for

        params, draft = generation.params, self.draft_model
        n, context = len(generation.samples), generation.context
        if draft is not None and chosen == self.speculate and not draft.holds(n, context):
            self.compute.call(draft.fit, max(n, self.reserved[0]),
                              max(context, self.reserved[1]))
        drafter = drafter_for(chosen, self.cfg, n, context, params, self.speculate_device, draft)
        return Speculation(drafter, params)

    def new_generation(self, prompt: Union[str, Prompt], max_new_tokens: int, n_samples: int,
                       params: SamplingParams, on_token: Optional[TokenCallback] = None,
                       stop: Sequence[str] = (), templated: bool = False,
                       speculate: Optional[str] = None) -> Generation:
        return self.generation_of(self.request(prompt, Asked(max_new_tokens, n_samples, params,
                                                             stop), templated),
                                  on_token, speculate)

    def generation_of(self, request: Request, on_token: Optional[TokenCallback] = None,
                      speculate: Optional[str] = None) -> Generation:
        generation = super().generation_of(request, on_token)
        generation.speculation = self.speculation_for(generation, speculate)
        return generation

    def reserve(self, n_slots: int, context: int) -> None:
        """Every later pipeline at least ``n_slots`` x ``context`` (a server's fixed layout: it
        never resizes), the draft model's slots too."""
        self.reserved = (n_slots, context)
        if self.draft_model is not None:
            self.compute.call(self.draft_model.fit, n_slots, context)

    def set_up(self) -> None:
        """A server: errors before it says ready."""
        self.prepare(*self.reserved)

    @abc.abstractmethod
    def prepare(self, n_slots: int, context: int) -> Scheduler:
        """A scheduler whose pipeline holds ``n_slots`` x ``context`` (caller holds ``_setup_lock``
        or is alone)."""

    @abc.abstractmethod
    def status(self) -> List[NodeStatus]:
        """This process's first."""

    def unavailable(self, timeout: float) -> Optional[str]:
        """None when the engine can take a request, else why not; ``timeout``: how long a ring may
        ask its nodes."""
        return None

    def setting_up(self) -> Optional[str]:
        """What a ring set-up under way waits for now (asking no node); None when none is."""
        return None

    def link_stats(self) -> List[Dict[str, Any]]:
        """Every link in ring order, as its sender counts it."""
        return []

    def ring_nodes(self) -> int:
        return 1

    def ring_id(self) -> object:
        """Which ring is up (None: none): counts of two rings do not subtract."""
        return None

    def submit(self, generation: Generation, micro_batch: int = 0,
               max_waiting: Optional[int] = None) -> Scheduler:
        """Queue ``generation`` on a pipeline that holds it; set-up and submission are one step
        under ``_setup_lock``, so no other set-up replaces the pipeline between them."""
        with self._setup_lock:
            scheduler = self.prepare(max(len(generation.samples), self.reserved[0]),
                                     max(generation.context, self.reserved[1]))
            generation.mark_set_up()
            if self.prompt_cache:
                scheduler.keep_prompts()
            scheduler.submit(generation, micro_batch, max_waiting)
        return scheduler

    def run(self, generation: Generation, micro_batch: int = 0,
            submitted: Optional[Scheduler] = None) -> Timing:
        """Run ``generation`` to its end (``submitted``: the scheduler it is on) and log one line.
        """
        request = next(_requests)
        try:
            scheduler = submitted or self.submit(generation, micro_batch)
            filled = self.kv_fill_s()  # the pipeline it runs on is set up now
            timing = scheduler.wait(generation)
            if generation.exits is not None:  # the nodes' fill time meanwhile
                generation.exits.kv_fill_s = max(0.0, self.kv_fill_s() - filled)
        except BaseException as e:
            log.warning("%s", failure_line(request, generation, e))
            raise
        log.info("%s", summary_line(request, generation, timing))
        return timing

    def generate(self, prompt: Union[str, Prompt], max_new_tokens: int = defaults.MAX_NEW_TOKENS,
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
        """Seconds filling the KV of blocks that early exits skipped."""
        return 0.0

    def on_close(self, callback: Callable[[], Any]) -> None:
        """``close`` calls ``callback`` after the nodes are let go, latest first."""
        if self._closers is None:
            self._closers = ExitStack()
        self._closers.callback(callback)

    def release(self) -> None:
        """Let nodes and links go; a local engine holds nothing."""

    def close(self) -> None:
        """``release``, then the ``on_close`` callbacks even when it fails, then the compute thread
        ends."""
        try:
            self.release()
        finally:
            closers, self._closers = self._closers, None
            try:
                if closers is not None:
                    closers.close()
            finally:
                compute = getattr(self, "compute", None)  # none if opening failed early
                if compute is not None:
                    compute.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
