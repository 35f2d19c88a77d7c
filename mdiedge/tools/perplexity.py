"""``mdiedge perplexity``: a text's perplexity under a model, computed the way llama.cpp's
``llama-perplexity`` computes it (``perplexity()`` in its tools/perplexity/perplexity.cpp):

- the text is tokenized once, with the BOS token before it where the model's tokenizer adds
  one (no EOS), and must hold at least ``2 * ctx`` tokens;
- it is cut into consecutive windows of ``ctx`` tokens (``len // ctx`` of them, at most
  ``chunks``), each run from position 0 on its own, its first token replaced by BOS where
  the tokenizer adds one;
- in each window the first ``ctx // 2`` positions are context only: the logits at positions
  ``ctx // 2 .. ctx - 2`` are scored against the next token, ``ctx - 1 - ctx // 2`` tokens
  per window;
- the perplexity is exp of the mean negative log-likelihood (NLL) over every scored token,
  and its standard error llama-perplexity's ``+/-``: ``ppl * sqrt(var / (count - 1))`` with
  ``var = mean(nll^2) - mean(nll)^2``.

A window runs through the model's KV cache ``batch`` positions at a time (one slot, the
positions going on), so that at the default of ``KERNEL_ROWS`` every quantized product takes
the few-row compiled kernels, where ``--cpu-dot`` applies; a larger batch is a prefill. The
model is the node ``mdiedge generate`` runs: on a CPU in float32 the torch-free ``CpuModel``
where it takes the file (with its float16 KV cache in the q8 mode, as llama.cpp's), else the
torch ``Transformer``; each with its own arithmetic.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..base.defaults import PERPLEXITY_MIN_CTX
from ..base.errors import UsageError
from ..base.humanize import plural

Progress = Callable[[int], None]  # told the positions each batch ran


class Tally(NamedTuple):
    """Scored tokens, the sum of their NLLs and of squares (llama.cpp's ``count``, ``nll``,
    ``nll2``)."""

    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0


def tallied(tally: Tally, nlls: Sequence[float]) -> Tally:
    return Tally(tally.count + len(nlls), tally.nll + math.fsum(nlls),
                 tally.nll2 + math.fsum(v * v for v in nlls))


def estimate(tally: Tally) -> Tuple[float, float]:
    """Perplexity and standard error as llama-perplexity prints them; 0 where NLLs do not spread."""
    if tally.count < 1:
        raise ValueError("no tokens scored")
    mean = tally.nll / tally.count
    ppl = math.exp(mean)
    spread = tally.nll2 / tally.count - mean * mean
    if tally.count < 2 or spread <= 0:
        return ppl, 0.0
    return ppl, ppl * math.sqrt(spread / (tally.count - 1))


def context_positions(ctx: int) -> int:
    return ctx // 2


def scored_per_window(ctx: int) -> int:
    return ctx - 1 - context_positions(ctx)


def cut_windows(tokens: Sequence[int], ctx: int, chunks: Optional[int] = None,
                bos: Optional[int] = None) -> List[List[int]]:
    """Consecutive ``ctx`` tokens (a partial one left out), at most ``chunks``, each first token
    replaced by ``bos`` where given."""
    count = len(tokens) // ctx
    if chunks is not None:
        count = min(count, chunks)
    windows = []
    for i in range(count):
        window = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            window[0] = bos
        windows.append(window)
    return windows


def text_tokens(tokenizer: Any, text: str) -> List[int]:
    """BOS first where the tokenizer adds one to a prompt, never an EOS."""
    return ([tokenizer.bos_id] if tokenizer.adds_bos else []) + list(tokenizer.encode(text))


def check_tokens(count: int, ctx: int, file: Any) -> None:
    """At least two windows' worth of tokens."""
    if count < 2 * ctx:
        raise UsageError(f"{file}: tokenizes to only {plural(count, 'token')}; --ctx {ctx} "
                         f"needs at least {2 * ctx} (2 x ctx)")


def window_nlls(model: Any, window: Sequence[int], batch: int,
                progress: Optional[Progress] = None) -> List[float]:
    """The window fed from position 0 through slot 0, ``batch`` positions at a time; the head runs
    on scored positions only. The torch model takes tensors, the torch-free one numpy arrays."""
    ctx, first = len(window), context_positions(len(window))
    ids, slots, nll, no_grad = _window_arrays(model, window)
    nlls: List[float] = []
    with no_grad:
        for start in range(0, ctx, batch):
            end = min(start + batch, ctx)
            hidden = model.run_blocks(model.embed_tokens(ids[None, start:end]), slots,
                                      [start])[0]  # (T, dim)
            lo, hi = max(first, start), min(end, ctx - 1)  # the last position predicts nothing
            if lo < hi:
                nlls.extend(nll(model.head_logits(hidden[lo - start:hi - start]),
                                ids[lo + 1:hi + 1]))
            if progress is not None:
                progress(end - start)
    return nlls


def _window_arrays(model: Any, window: Sequence[int]) -> Tuple[Any, Any, Any, Any]:
    """The window's ids and slot 0 as the model takes them, its NLL function, and the context
    its passes run in (torch's no_grad)."""
    import contextlib

    import numpy as np

    if not hasattr(model, "parameters"):  # the torch-free CpuModel
        return (np.asarray(window, dtype=np.int64), np.zeros(1, dtype=np.int64), cross_entropy,
                contextlib.nullcontext())
    import torch

    device = next(model.parameters()).device

    def torch_nll(logits: Any, targets: Any) -> List[float]:
        return torch.nn.functional.cross_entropy(logits.double(), targets,
                                                 reduction="none").tolist()

    return (torch.tensor(window, device=device), torch.zeros(1, dtype=torch.long, device=device),
            torch_nll, torch.no_grad())


def cross_entropy(logits: Any, targets: Any) -> List[float]:
    """Each row's negative log-likelihood of its target, in float64 (torch's
    ``cross_entropy`` of the logits in double): log-sum-exp less the target's logit."""
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)
    top = z.max(axis=-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=-1))
    return (lse - z[np.arange(z.shape[0]), np.asarray(targets)]).tolist()


def score(model: Any, windows: Sequence[Sequence[int]], batch: int,
          progress: Optional[Progress] = None) -> Tally:
    model.setup_cache(1, len(windows[0]))
    tally = Tally()
    for window in windows:
        tally = tallied(tally, window_nlls(model, window, batch, progress))
    return tally


def read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None


class Measurement:
    """Prepared before the weights load: text side, windows, and what the run reports."""

    def __init__(self, text_model: Any, file: Path, ctx: int, chunks: Optional[int]) -> None:
        max_ctx = text_model.cfg.max_seq_len
        if ctx > max_ctx:
            raise UsageError(f"--ctx: expected an integer {PERPLEXITY_MIN_CTX}..{max_ctx} (the model's "
                             f"context), got {ctx}")
        self.text_model, self.file, self.ctx = text_model, file, ctx
        tokenizer = text_model.tokenizer
        tokens = text_tokens(tokenizer, read_text(file))
        check_tokens(len(tokens), ctx, file)
        self.windows = cut_windows(tokens, ctx, chunks,
                                   tokenizer.bos_id if tokenizer.adds_bos else None)

    @property
    def positions(self) -> int:
        return len(self.windows) * self.ctx

    def run(self, model: Any, batch: int, progress: Optional[Progress] = None
            ) -> Dict[str, Any]:
        """``--json``'s object but the cpu-dot mode and threads."""
        started = time.perf_counter()
        tally = score(model, self.windows, batch, progress)
        seconds = time.perf_counter() - started
        ppl, stderr = estimate(tally)
        return {"model": str(self.text_model.path), "file": str(self.file), "ctx": self.ctx,
                "batch": batch, "windows": len(self.windows), "tokens": tally.count,
                "nll": tally.nll / tally.count, "ppl": ppl, "ppl_stderr": stderr,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(self.positions / max(seconds, 1e-9), 2)}


def open_model(text_model: Any, device: str, threads: int, torch_model: bool = False) -> Any:
    """The node ``mdiedge generate`` would run on ``device`` (``mdiedge.model.chunks``): on a
    CPU in float32 the torch-free path where it takes the file, else the torch model (float32,
    a GGUF file's blocks kept; ``torch_model``: that one in any case); ``threads`` threads (0:
    every core allowed), as the engine's opening sets them."""
    from ..base.accel import warn_if_uncompiled
    from ..base.threads import available_cores, node_threads, use_threads
    from ..model.chunks import open_chunk

    use_threads(node_threads(threads, 1, available_cores()))
    model = open_chunk(text_model.path, None, True, True, device=device,
                       torch_for="the torch model's perplexity" if torch_model else None)
    warn_if_uncompiled()
    return model
