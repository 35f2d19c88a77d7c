"""A one-process decoding loop over a pipeline of ``LocalStage``s, plain or speculative: the
reference the scheduler's speculation must equal (tests) and the harness of
``bin/bench-speculate``. One sample; the prompt in one prefill message; then each step one
decode message of its last token (plain) or of its last token and its drafts (``Speculation``,
k + 1 positions marked ``rewind``), the head scoring every position."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch

from mdiedge.model.checkpoint import load_model
from mdiedge.model.sampling import SamplingParams, sample_generator, sample_rows
from mdiedge.runtime import messages
from mdiedge.runtime.messages import Message
from mdiedge.placement.partition import split_layers
from mdiedge.runtime.pipeline import EmbedAndHead, Pipeline
from mdiedge.runtime.speculation import Speculation
from mdiedge.runtime.stages import LocalStage


def build(path: Path, stages: int, n_slots: int = 1, context: int = 512
          ) -> Tuple[Pipeline, EmbedAndHead]:
    """The model at ``path`` split over ``stages`` in-process stages, as LocalEngine does."""
    from mdiedge.model.checkpoint import load_config

    n_layers = load_config(path).n_layers
    ranges = split_layers(n_layers, [1.0] * stages) if stages > 1 else [(0, n_layers)]
    chunks = [load_model(path, layers=r, embedding=i == 0, head=i == 0)
              for i, r in enumerate(ranges)]
    last = len(chunks) - 1
    return (Pipeline([LocalStage(c, n_slots, context, trim_prefill=i == last)
                      for i, c in enumerate(chunks)]), EmbedAndHead(chunks[0]))


@dataclass
class Run:
    tokens: List[int]  # generated tokens (the prompt not included)
    steps: int  # decode steps after the prefill
    seconds: float = 0.0
    ks: List[int] = field(default_factory=list)  # tokens drafted per step


def _step(pipeline: Pipeline, ends: EmbedAndHead, sample_id: int, position: int,
          tokens: Sequence[int], prefill: bool = False, rewind: bool = False) -> torch.Tensor:
    """Hidden states (T, dim) after the pipeline for ``tokens`` from ``position``."""
    hidden = ends.embed([list(tokens)])
    pipeline.submit(Message(messages.ACTIVATION, [sample_id], [position], hidden,
                            prefill=prefill, rewind=rewind))
    out = pipeline.receive()
    assert out.hidden is not None
    return out.hidden[0]


def decode(pipeline: Pipeline, ends: EmbedAndHead, prompt: Sequence[int], n: int,
           params: SamplingParams, speculation: Optional[Speculation] = None,
           sample_id: int = 0, generator: Optional[torch.Generator] = None) -> Run:
    """``n`` tokens after ``prompt`` (no stop at the end of text)."""
    gen = generator or sample_generator(params.seed, sample_id)
    t0 = time.perf_counter()
    last = _step(pipeline, ends, sample_id, 0, prompt, prefill=True)[-1:]
    tokens = list(prompt)
    out = sample_rows(ends.head(last), params, [gen])
    run = Run(out, 0)
    while len(run.tokens) < n:
        tokens_so_far = tokens + run.tokens
        budget = n - len(run.tokens)
        if speculation is None:
            hidden = _step(pipeline, ends, sample_id, len(tokens_so_far) - 1, tokens_so_far[-1:])
            new = sample_rows(ends.head(hidden), params, [gen])
        else:
            draft = speculation.draft(sample_id, tokens_so_far, budget)
            hidden = _step(pipeline, ends, sample_id, draft.position, draft.tokens, rewind=True)
            new = speculation.settle(sample_id, draft, ends.head(hidden), gen)
            run.ks.append(draft.drafted)
        run.tokens += new[:budget]
        run.steps += 1
    if speculation is not None:
        speculation.release(sample_id)
    pipeline.submit(Message(messages.RELEASE, [sample_id], [0]))
    pipeline.receive()
    run.seconds = time.perf_counter() - t0
    return run
