"""A request's samples and the rule that turns logits into their next tokens. Each sample draws from
its own generator, so its tokens do not depend on what it shares a message with."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..base.arrays import float32
from ..base.errors import GenerationError, MdiedgeError
from ..base.request import Request
from ..model.sampling import (Generator, TokenLogprob, sample_generator, sample_rows,
                              token_logprobs)
from ..model.stopping import TextOutput

TokenCallback = Callable[[int, int], None]  # (sample index, token id)
TextFactory = Callable[[Sequence[int]], TextOutput]  # a sample's prompt -> its text output


@dataclass(eq=False)
class Sample:
    index: int
    prompt: List[int]
    generator: Generator
    sid: int = 0  # ring-wide sample id, given at admission; each node maps it to a KV row
    tokens: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "eos", "stop", "length", "cancelled" or "error"
    first_token_s: float = 0.0
    released: bool = False  # its KV rows were freed on every node
    output: Optional[TextOutput] = None  # its text and stop strings (an engine's requests)
    logprobs: List[TokenLogprob] = field(default_factory=list)  # one per token, if asked
    constraint: Optional[Any] = None  # the grammar its tokens follow (model/grammar.py)
    # its rows computed as a prefill: [start, end) of each message that held more than
    # defaults.DECODE_ROWS of them, in order (a replay repeats them: runtime.plan.replay)
    runs: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """Up to its stop string if it stopped on one."""
        assert self.output is not None, "a sample of a request with no text output"
        return self.output.final(self.finish_reason == "stop")

    @property
    def position(self) -> int:
        """Position of the next token to feed (the last sampled one)."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclass
class Timing:
    """``total_s`` from arrival to end, of which ``setup_s`` set a ring up for it (0 on a ring
    already up); tokens/s count the rest. ``samples``: the request's, each of whose first
    token the prefill made (``decode_tokens_per_s`` counts the others over ``decode_s``)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    setup_s: float = 0.0
    samples: int = 1

    @property
    def generation_s(self) -> float:
        return max(0.0, self.total_s - self.setup_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.generation_s if self.generation_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """The decode's speed alone: tokens after each sample's first, over ``decode_s``."""
        decoded = max(0, self.new_tokens - self.samples)
        return decoded / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> Dict[str, float]:
        return {"prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "setup_s": round(self.setup_s, 4), "generation_s": round(self.generation_s, 4),
                "total_s": round(self.total_s, 4), "new_tokens": self.new_tokens,
                "tokens_per_s": round(self.tokens_per_s, 2),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2)}


@dataclass
class Recovery:
    """One recovery as a generation saw it: lost nodes, after how many tokens, ``recover_s`` (set
    once the replay is back) and the tokens replayed."""

    nodes: List[str]
    token_index: int
    detect_s: float
    tokens_replayed: int = 0
    recover_s: float = 0.0
    started: float = field(default=0.0, repr=False)  # perf_counter() at detection
    pending: int = field(default=0, repr=False)  # replay messages not back yet

    def as_dict(self) -> Dict[str, object]:
        return {"nodes": list(self.nodes), "token_index": self.token_index,
                "detect_s": round(self.detect_s, 3), "recover_s": round(self.recover_s, 3),
                "tokens_replayed": self.tokens_replayed}


@dataclass
class ExitCounts:
    """Decode tokens by the blocks they ran (``n_layers``: all) and this process's KV-fill seconds.
    """

    n_layers: int
    by_depth: Dict[int, int] = field(default_factory=dict)
    kv_fill_s: float = 0.0

    def add(self, depth: int, rows: int) -> None:
        depth = depth or self.n_layers
        self.by_depth[depth] = self.by_depth.get(depth, 0) + rows

    @property
    def tokens(self) -> int:
        return sum(self.by_depth.values())

    def as_dict(self) -> Dict[str, object]:
        """``exit_rate``: per block (1-based), the share of decode tokens that exited after it;
        ``mean_layers``: blocks per decode token."""
        total = self.tokens
        rates = {str(d): round(n / total, 4) for d, n in sorted(self.by_depth.items())
                 if d < self.n_layers} if total else {}
        mean = sum(d * n for d, n in self.by_depth.items()) / total if total else 0.0
        return {"tokens": total, "exited": total - self.by_depth.get(self.n_layers, 0),
                "exit_rate": rates, "mean_layers": round(mean, 3),
                "kv_fill_s": round(self.kv_fill_s, 4)}


def constrained(samples: Sequence[Sample], logits: np.ndarray) -> np.ndarray:
    """Rows of samples under a grammar masked to the tokens it allows next (-inf elsewhere)."""
    if all(s.constraint is None for s in samples):
        return logits
    rows = logits.copy()
    for i, sample in enumerate(samples):
        if sample.constraint is not None:
            rows[i] = sample.constraint.mask(logits[i])
    return rows


class Generation:

    def __init__(self, request: Request, eos_ids: Sequence[int],
                 on_token: Optional[TokenCallback] = None,
                 output: Optional[TextFactory] = None) -> None:
        self.params = params = request.params
        self.max_new_tokens = request.max_new_tokens
        self.eos_ids = frozenset(eos_ids)
        self.on_token = on_token
        self.samples = [Sample(i, list(request.prompt.ids), sample_generator(params.seed, i))
                        for i in range(request.n_samples)]
        if output is not None:
            for sample in self.samples:
                sample.output = output(sample.prompt)
        self.started = time.perf_counter()
        self.timing = Timing(samples=request.n_samples)
        self.set_up_at = 0.0  # perf_counter() when a ring for it was up (its set-up done)
        self.admitted_at = 0.0  # perf_counter() when its samples got KV rows
        self.prefilled_at = 0.0  # when every sample had its first token
        self.cancel_requested = False  # set by any thread; the scheduler acts on it
        self.cache_prompt = True  # may reuse, and leave, KV rows in the prompt cache
        self.cached_tokens = 0  # prompt tokens whose KV rows the prompt cache gave
        self.error: Optional[BaseException] = None  # set when the pipeline failed under it
        self.recoveries: List[Recovery] = []  # lost nodes it lived through
        self.exits: Optional[ExitCounts] = None  # set by a scheduler that exits early
        # speculative decoding of its samples (``mdiedge.runtime.speculation.Speculation``),
        # set by the engine before it is submitted; None: one token per step
        self.speculation: Optional[Any] = None
        # the prompt's log-probabilities (entry p: prompt[p] after the tokens before it; p 0
        # has none), asked for by ``score_prompt``; None: not asked
        self.prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None
        self._ended = threading.Event()  # set by the scheduler's loop: nothing left to wait for

    @property
    def active(self) -> List[Sample]:
        return [s for s in self.samples if not s.done]

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.done for s in self.samples)

    @property
    def settled(self) -> bool:
        """No sample holds KV rows (released, or never admitted)."""
        return all(s.released or not s.sid for s in self.samples)

    @property
    def context(self) -> int:
        return len(self.samples[0].prompt) + self.max_new_tokens

    def cancel(self) -> None:
        """Its KV rows are freed on every node."""
        self.cancel_requested = True

    def end(self, reason: str, samples: Optional[Sequence[Sample]] = None) -> None:
        """``reason``: "cancelled" or "error"; ending by sampling is ``accept``'s."""
        for sample in self.samples if samples is None else samples:
            if not sample.done:
                sample.finish_reason = reason

    def fail(self, error: BaseException) -> None:
        """Failed on its own: ends with ``error`` (the first stays), rows freed as messages come
        back; others go on."""
        if self.error is None:
            self.error = error if isinstance(error, MdiedgeError) else \
                GenerationError(f"{type(error).__name__}: {error}")
        self.cancel_requested = True
        self.end("error")

    def broken(self, error: BaseException) -> None:
        """The pipeline broke: ends with ``error``; a shared draft model's slots are free again."""
        self.error = error
        if self.speculation is not None:
            self.speculation.close([s.index for s in self.samples])

    def release(self, samples: Sequence[Sample]) -> List[Sample]:
        """How a sample ends, in one place: live ones cancelled when asked, ended ones holding rows
        marked released (the caller frees them); the timing closes once all ended. Those released
        now."""
        if self.cancel_requested:
            self.end("cancelled", samples)
        ended = [s for s in samples if s.done and not s.released]
        for sample in ended:
            sample.released = True
            if self.speculation is not None:
                self.speculation.release(sample.index)
        if ended and all(s.done for s in self.samples):
            self.finish()
        return ended

    def wake(self) -> None:
        self._ended.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether ``wake`` came within ``timeout`` s."""
        return self._ended.wait(timeout)

    def accept(self, samples: Sequence[Sample], logits: Any) -> None:
        """One token per sample from its row of ``logits`` (B, vocab)."""
        if self.cancel_requested:
            self.end("cancelled", samples)  # "error" stays
            return
        logits = float32(logits)
        tokens = sample_rows(constrained(samples, logits), self.params,
                             [s.generator for s in samples],
                             [(s.prompt, s.tokens) for s in samples])
        for i, (sample, token) in enumerate(zip(samples, tokens)):
            self.take(sample, [token], self.scored(logits[i:i + 1], [token]))

    def score_prompt(self) -> None:
        """The first sample's prefill comes back whole, every row through the head (so no prompt
        cache)."""
        self.prompt_logprobs = [None] * len(self.samples[0].prompt)
        self.cache_prompt = False

    def unscored(self, sample: Sample, start: int, end: int) -> int:
        """``start`` when the prefill of [start, end) scores prompt tokens not scored yet (to come
        back whole); else -1."""
        wanted = self.prompt_logprobs
        if wanted is None or sample.index != 0 or \
                all(p is not None for p in wanted[start + 1:end + 1]):
            return -1
        return start

    def scored_prompt(self, start: int, logits: Any) -> None:
        """Log-probabilities of the prompt tokens each row of ``logits`` (from ``start``) predicts.
        """
        prompt, wanted = self.samples[0].prompt, self.prompt_logprobs
        count = min(logits.shape[0], len(prompt) - 1 - start)
        if wanted is not None and count > 0:
            wanted[start + 1:start + 1 + count] = token_logprobs(
                logits[:count], prompt[start + 1:start + 1 + count], self.params.top_logprobs or 0)

    def constrain(self, grammar: Any) -> None:
        """A drafted token outside ``grammar`` is rejected when verified."""
        for sample in self.samples:
            sample.constraint = grammar.matcher()

    def scored(self, logits: Any, tokens: Sequence[int]) -> Optional[List[TokenLogprob]]:
        """None unless the request asked for log-probabilities."""
        top = self.params.top_logprobs
        return None if top is None else token_logprobs(logits, tokens, top)

    def settle(self, samples: Sequence[Sample], logits: Any, drafts: Dict[int, Any]) -> None:
        """A verifying step's tokens: ``logits`` (B, T, vocab), ``drafts`` by sample id (a
        non-speculating request merged in takes its last position)."""
        if self.speculation is None or samples[0].sid not in drafts:
            self.accept(samples, logits[:, -1])
            return
        if self.cancel_requested:
            self.end("cancelled", samples)  # "error" stays
            return
        logits = float32(logits)
        for i, sample in enumerate(samples):
            draft, rows = drafts[sample.sid], logits[i]
            if sample.constraint is not None:
                rows = sample.constraint.masked_drafts(rows, draft.proposal.tokens)
            tokens = self.speculation.settle(sample.index, draft, rows,
                                             sample.generator, (sample.prompt, sample.tokens))
            self.take(sample, tokens, self.scored(logits[i], tokens))

    def take(self, sample: Sample, tokens: Sequence[int],
             logprobs: Optional[Sequence[TokenLogprob]] = None) -> None:
        """Append ``tokens`` until one ends the sample (end token, stop string, budget); later ones
        are dropped."""
        now = time.perf_counter()
        for i, token in enumerate(tokens):
            if sample.done:
                return
            if not sample.tokens:
                sample.first_token_s = now - self.started
            if token in self.eos_ids:
                sample.finish_reason = "eos"
                return
            if logprobs is not None:
                sample.logprobs.append(logprobs[i])
            sample.tokens.append(token)
            self.timing.new_tokens += 1
            if sample.constraint is not None:
                sample.constraint.take([token])
            stopped = sample.output is not None and sample.output.push(token)
            if self.on_token is not None:
                self.on_token(sample.index, token)
            if stopped or \
                    sample.constraint is not None and sample.constraint.finished:
                sample.finish_reason = "stop"
            elif len(sample.tokens) >= self.max_new_tokens:
                sample.finish_reason = "length"

    def mark_set_up(self) -> None:
        self.set_up_at = time.perf_counter()

    def mark_admitted(self) -> None:
        self.admitted_at = time.perf_counter()

    def mark_prefilled(self) -> None:
        if not self.prefilled_at:
            self.prefilled_at = time.perf_counter()

    def finish(self) -> Timing:
        """Prefill from admission to the last first token, decode after."""
        now = time.perf_counter()
        admitted = self.admitted_at or self.started
        prefilled = self.prefilled_at or now
        self.timing.total_s = now - self.started
        self.timing.setup_s = max(0.0, self.set_up_at - self.started) if self.set_up_at else 0.0
        self.timing.prefill_s = max(0.0, prefilled - admitted)
        self.timing.decode_s = max(0.0, now - prefilled)
        return self.timing
