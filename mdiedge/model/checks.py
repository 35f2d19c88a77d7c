"""Whether a model fits what holds it, before memory is spent: config against the checkpoint's
headers, a chunk's memory against free memory, every weight finite, the tokenizer against the
vocabulary; each failure one line naming the value and its source."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Optional, Set, Tuple

import numpy as np

from ..base.errors import CheckpointError, ConfigError, TokenizerError
from ..base.memory import available_bytes
from .arrays import is_torch
from .config import ModelConfig
from .tensors import TensorSource, expected_shape, tensor_plan

HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.")
HF_EXPERT = re.compile(r"model\.layers\.0\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.")
FINITE_CHUNK = 1 << 22  # elements checked at a time (a bool temporary of this many bytes)
GiB = float(1 << 30)


def indices(names: Iterable[str], pattern: "re.Pattern[str]") -> Set[int]:
    """Block or expert indices ``pattern``'s group finds."""
    found: Set[int] = set()
    for name in names:
        match = pattern.match(name)
        if match is not None:
            found.add(int(match.group(1)))
    return found


def _all_of(found: Set[int], count: int) -> bool:
    """Exactly 0..count-1, without building the range."""
    return len(found) == count and (not found or (min(found) == 0 and max(found) == count - 1))


def _span(found: Set[int]) -> str:
    return f"{min(found)}..{max(found)} ({len(found)})" if found else "none"


def check_blocks(cfg: ModelConfig, blocks: Set[int], where: Path, key: str = "num_hidden_layers",
                 experts: Optional[Set[int]] = None) -> None:
    """A config naming more blocks (or experts) than the file has fails before any is built."""
    if not _all_of(blocks, cfg.n_layers):
        raise CheckpointError(f"{where}: {key} = {cfg.n_layers}, but the checkpoint holds "
                              f"blocks {_span(blocks)}: the config does not match the weights")
    if experts is not None and cfg.is_moe and not _all_of(experts, cfg.n_experts):
        raise CheckpointError(f"{where}: num_local_experts = {cfg.n_experts}, but the "
                              f"checkpoint's block 0 holds experts {_span(experts)}: the "
                              f"config does not match the weights")


def check_source(cfg: ModelConfig, source: TensorSource) -> None:
    """Blocks and experts counted first, so a config naming 10^9 is refused before a plan is made,
    then every tensor."""
    names = list(source.names())
    check_blocks(cfg, indices(names, HF_BLOCK), source.path,
                 experts=indices(names, HF_EXPERT) if cfg.is_moe else None)
    check_plan(cfg, source, tensor_plan(cfg, (0, cfg.n_layers), True, True))


def check_plan(cfg: ModelConfig, source: TensorSource, plan: "dict[str, str]") -> None:
    """Present and of the implied shape (where headers say), before allocating."""
    available = set(source.names())
    for ours, theirs in plan.items():
        if theirs not in available:
            raise CheckpointError(f"{source.path}: missing tensor {theirs!r}")
        got, want = source.shape(theirs), expected_shape(cfg, ours)
        if got is not None and got != want:
            raise CheckpointError(f"{source.path}: tensor {theirs!r} has shape {got}, expected "
                                  f"{want} from the config: the config does not match the "
                                  f"weights")


def chunk_bytes(cfg: ModelConfig, source: TensorSource, plan: "dict[str, str]",
                itemsize: int, native: bool) -> int:
    """Float weights at ``itemsize``, quantized ones (CPU float32, ``native``) at their stored size.
    """
    from .qtypes import kernel_qtype

    total = 0
    for ours, theirs in plan.items():
        stored = source.stored_bytes(theirs) if native and kernel_qtype(source, theirs) else None
        if stored is None:
            count = 1
            for n in expected_shape(cfg, ours):
                count *= n
            stored = count * itemsize
        total += stored
    return total


def check_memory(need: int, device: str, what: str,
                 remedy: str = "use more nodes, --quantize, or a smaller model") -> None:
    """The free memory of ``device`` (within a cgroup's limit), or a ConfigError with ``remedy``."""
    free, place = free_bytes(device)
    if free is not None and need > free:
        raise ConfigError(f"{what}: {need / GiB:.2f} GiB needed, {free / GiB:.2f} GiB free "
                          f"on {place}: {remedy}")


def free_bytes(device: str) -> "Tuple[Optional[int], str]":
    """(bytes or None, where that is in words), within a cgroup's limit."""
    if str(device).startswith("cuda"):  # torch is loaded wherever CUDA is asked for
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info(torch.device(device))[0]), device
    return available_bytes(), "this node"


def check_finite(t: Any, name: str, where: Path) -> None:
    """Checked in chunks (a small temporary)."""
    torch = is_torch(t)
    floating = t.is_floating_point() if torch else np.issubdtype(t.dtype, np.floating)
    if not floating or not len(t.reshape(-1)):
        return
    flat = t.detach().reshape(-1) if torch else t.reshape(-1)
    finite = (lambda part: part.isfinite()) if torch else np.isfinite
    for start in range(0, flat.shape[0], FINITE_CHUNK):
        part = flat[start:start + FINITE_CHUNK]
        if not bool(finite(part).all()):
            bad = part[~finite(part)][0].item()
            raise CheckpointError(f"{where}: tensor {name!r} holds {bad} (a weight that is not "
                                  f"a finite number): the checkpoint is corrupt")


def check_tokenizer(cfg: ModelConfig, tokenizer: Any, where: Any) -> None:
    """A model may pad its vocabulary past the tokenizer's, never the reverse; BOS/EOS ids must be
    tokens."""
    size = int(tokenizer.vocab_size)
    if size > cfg.vocab_size:
        raise TokenizerError(f"{where}: the tokenizer has {size} tokens, the model's "
                             f"vocabulary {cfg.vocab_size}: not this model's tokenizer")
    for key in ("bos_id", "eos_id"):
        value = getattr(tokenizer, key, None)
        if value is not None and not 0 <= int(value) < cfg.vocab_size:
            raise TokenizerError(f"{where}: the tokenizer's {key} {value} is not a token of "
                                 f"the model (0..{cfg.vocab_size - 1})")


def describe(layers: Tuple[int, int], embedding: bool, head: bool) -> str:
    parts = [f"blocks [{layers[0]}, {layers[1]})"]
    parts += ["the embedding"] if embedding else []
    parts += ["the head"] if head else []
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
