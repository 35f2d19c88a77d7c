"""The generation loop, independent of where the blocks run.

``Generation`` owns the samples (prompt, generator, tokens, slot, stop state) and turns
logits into tokens; ``run_local`` drives it with a model chunk that holds every block, the
``--nodes 1`` engine. The ring's starter drives the same ``Generation`` over the network.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..base.errors import GenerationError
from ..model.sampling import SamplingParams, sample_generator, sample_rows

TokenCallback = Callable[[int, int], None]  # (sample index, token id)


@dataclass
class Sample:
    index: int
    prompt: List[int]
    generator: torch.Generator
    slot: int = -1
    tokens: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "eos" or "length"
    first_token_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Position of the next token to feed (the last sampled one)."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> Dict[str, float]:
        return {"prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
                "total_s": round(self.total_s, 4), "new_tokens": self.new_tokens,
                "tokens_per_s": round(self.tokens_per_s, 2)}


def check_context(prompt_len: int, max_new_tokens: int, context: int) -> None:
    if prompt_len == 0:
        raise GenerationError("empty prompt: the model needs at least one token (a BOS id or text)")
    if max_new_tokens < 1:
        raise GenerationError(f"token budget must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > context:
        raise GenerationError(
            f"prompt of {prompt_len} tokens plus {max_new_tokens} new tokens exceeds the "
            f"context of {context} tokens")


class Generation:
    """Samples of one request and the rule that turns logits into their next tokens."""

    def __init__(self, prompt: Sequence[int], n_samples: int, max_new_tokens: int,
                 params: SamplingParams, eos_ids: Sequence[int], context: int,
                 on_token: Optional[TokenCallback] = None) -> None:
        if n_samples < 1:
            raise GenerationError(f"number of samples must be >= 1, got {n_samples}")
        check_context(len(prompt), max_new_tokens, context)
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(eos_ids)
        self.on_token = on_token
        self.samples = [Sample(i, list(prompt), sample_generator(params.seed, i))
                        for i in range(n_samples)]
        self.started = time.perf_counter()
        self.timing = Timing()

    @property
    def active(self) -> List[Sample]:
        return [s for s in self.samples if not s.done]

    def accept(self, samples: Sequence[Sample], logits: Tensor) -> None:
        """Sample one token for each of ``samples`` from its row of ``logits`` (B, vocab)."""
        tokens = sample_rows(logits, self.params, [s.generator for s in samples])
        now = time.perf_counter()
        for sample, token in zip(samples, tokens):
            if not sample.tokens:
                sample.first_token_s = now - self.started
            if token in self.eos_ids:
                sample.finish_reason = "eos"
                continue
            sample.tokens.append(token)
            self.timing.new_tokens += 1
            if self.on_token is not None:
                self.on_token(sample.index, token)
            if len(sample.tokens) >= self.max_new_tokens:
                sample.finish_reason = "length"

    def finish(self) -> Timing:
        self.timing.total_s = time.perf_counter() - self.started
        return self.timing


def run_local(model, generation: Generation, micro_batch: int = 0) -> Timing:  # model: Transformer
    """Run a whole generation on one in-process model that holds every block.

    Each sample is prefilled alone (its own slot), then decode steps run the active samples
    in micro-batches of ``micro_batch`` rows (0: all of them in one forward)."""
    length = len(generation.samples[0].prompt) + generation.max_new_tokens
    if model.n_slots < len(generation.samples) or model.max_seq_len < length:
        model.setup_cache(len(generation.samples), length)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for slot, sample in enumerate(generation.samples):
            sample.slot = slot
            ids = torch.tensor([sample.prompt], device=_device(model))
            logits = model(ids, torch.tensor([slot], device=ids.device), [0])
            generation.accept([sample], logits)
        generation.timing.prefill_s = time.perf_counter() - t0
        while True:
            active = generation.active
            if not active:
                break
            size = micro_batch or len(active)
            for i in range(0, len(active), size):
                group = active[i:i + size]
                device = _device(model)
                ids = torch.tensor([[s.tokens[-1]] for s in group], device=device)  # (B, 1)
                slots = torch.tensor([s.slot for s in group], device=device)
                logits = model(ids, slots, [s.position for s in group])
                generation.accept(group, logits)
        generation.timing.decode_s = time.perf_counter() - t0 - generation.timing.prefill_s
    return generation.finish()


def _device(model) -> torch.device:  # model: Transformer
    return next(model.parameters()).device
