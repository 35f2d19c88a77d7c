"""Names and sources of a checkpoint's tensors: our parameter names <-> Hugging Face names
(the names every source answers to; each family declares its own, ``mdiedge.model.families``),
and the interface of a source that reads them lazily."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple


if TYPE_CHECKING:
    from torch import Tensor

from ..base.errors import CheckpointError
from .config import ModelConfig
from .families import family_of, llama

# the Llama family's names, which every family so far shares for the embedding and the head
GLOBAL_NAMES = llama.HF_GLOBAL_NAMES
BLOCK_NAMES = llama.HF_BLOCK_NAMES


def expand_experts(names: Mapping[str, str], n_experts: int) -> Dict[str, str]:
    """A family's block names with each ``{e}`` name repeated for experts 0..n_experts-1."""
    out: Dict[str, str] = {}
    for ours, theirs in names.items():
        if "{e}" in ours:
            for e in range(n_experts):
                out[ours.format(e=e)] = theirs.format(e=e)
        else:
            out[ours] = theirs
    return out


def block_names(cfg: ModelConfig) -> Dict[str, str]:
    """Our names -> Hugging Face names of one block of ``cfg``'s family (prefixes stripped)."""
    return expand_experts(family_of(cfg).hf_block_names, cfg.n_experts)


def tensor_plan(cfg: ModelConfig, layers: Tuple[int, int], embedding: bool, head: bool
                ) -> Dict[str, str]:
    """Our parameter names -> Hugging Face names for one chunk of the model."""
    family = family_of(cfg)
    names = family.hf_global_names
    plan: Dict[str, str] = {}
    if embedding:
        plan["embed.weight"] = names["embed.weight"]
    block = block_names(cfg) if layers[1] > layers[0] else {}
    for i in range(*layers):
        for ours, theirs in block.items():
            plan[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if head:
        plan["norm.weight"] = names["norm.weight"]
        if cfg.tie_embeddings:
            if not embedding:
                plan["lm_head.weight"] = names["embed.weight"]
        else:
            plan["lm_head.weight"] = names["lm_head.weight"]
    return plan


def expected_shape(cfg: ModelConfig, ours: str) -> Tuple[int, ...]:
    """The shape of our parameter ``ours`` (Hugging Face's (out, in) for a matrix, (out,) for
    a layer's bias)."""
    key = ours.rsplit(".", 2)[-2] if "." in ours else ours
    d, h = cfg.dim, cfg.intermediate_size
    shape = {"embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "norm": (d,),
             "attn_norm": (d,), "mlp_norm": (d,), "post_attn_norm": (d,), "post_mlp_norm": (d,),
             "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
             "wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d),
             "wv": (cfg.kv_dim, d), "wo": (d, cfg.q_dim), "gate": (h, d), "up": (h, d),
             "down": (d, h), "router": (cfg.n_experts, d)}[key]
    return shape[:1] if ours.endswith(".bias") else shape


class TensorSource:
    """Reads named tensors lazily from one checkpoint; records what it read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.read_names: List[str] = []

    def names(self) -> Sequence[str]:
        raise NotImplementedError

    def _read(self, name: str) -> Tensor:
        raise NotImplementedError

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """The float shape of tensor ``name`` as stored, read from the file's metadata only
        (None: not known before it is read, or stored in quantized blocks)."""
        return None

    def stored_bytes(self, name: str) -> Optional[int]:
        """Bytes tensor ``name`` takes in its stored (quantized) form, None when unknown."""
        return None

    def get(self, name: str) -> Tensor:
        self.read_names.append(name)
        return self._read(name)

    def read_into(self, name: str, out: Tensor) -> None:
        """Copy tensor ``name`` into ``out`` (same shape, any dtype); a shape mismatch is a
        CheckpointError. Sources that can read straight into ``out`` override this."""
        t = self.get(name)
        self._check_shape(name, tuple(t.shape), tuple(out.shape))
        out.copy_(t)

    def _check_shape(self, name: str, got: Tuple[int, ...], want: Tuple[int, ...]) -> None:
        if got != want:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {got}, "
                                  f"expected {want}")

    def rope_pairs(self, name: str) -> bool:
        """Whether ``raw_array(name, hf_order=False)`` gives the rows of Q or K ``name`` in
        llama.cpp's RoPE-pair order without a copy (a Llama GGUF file's); else only Hugging
        Face's order is read."""
        return False

    def release(self, array: Any) -> None:
        """``array`` (read from this source) is not read again: where it maps the file, its
        pages may leave this process's resident memory (read from the file again if touched)."""

    def close(self) -> None:
        pass
