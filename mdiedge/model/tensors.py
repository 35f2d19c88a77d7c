"""Names and sources of a checkpoint's tensors: our parameter names <-> Hugging Face names
(the names every source answers to), and the interface of a source that reads them lazily."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from ..base.errors import CheckpointError
from .config import ModelConfig

# Our parameter name -> Hugging Face name, declaratively. Block names are relative to
# ``layers.{i}.`` (ours) and ``model.layers.{i}.`` (theirs).
GLOBAL_NAMES: Dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK_NAMES: Dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
MOE_BLOCK_NAMES: Dict[str, str] = {
    "mlp.router.weight": "block_sparse_moe.gate.weight",
    "mlp.experts.{e}.gate.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "mlp.experts.{e}.down.weight": "block_sparse_moe.experts.{e}.w2.weight",
    "mlp.experts.{e}.up.weight": "block_sparse_moe.experts.{e}.w3.weight",
}


def block_names(cfg: ModelConfig) -> Dict[str, str]:
    if not cfg.is_moe:
        return BLOCK_NAMES
    names = {k: v for k, v in BLOCK_NAMES.items() if not k.startswith("mlp.")}
    for ours, theirs in MOE_BLOCK_NAMES.items():
        if "{e}" in ours:
            for e in range(cfg.n_experts):
                names[ours.format(e=e)] = theirs.format(e=e)
        else:
            names[ours] = theirs
    return names


def tensor_plan(cfg: ModelConfig, layers: Tuple[int, int], embedding: bool, head: bool
                ) -> Dict[str, str]:
    """Our parameter names -> Hugging Face names for one chunk of the model."""
    plan: Dict[str, str] = {}
    if embedding:
        plan["embed.weight"] = GLOBAL_NAMES["embed.weight"]
    for i in range(*layers):
        for ours, theirs in block_names(cfg).items():
            plan[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if head:
        plan["norm.weight"] = GLOBAL_NAMES["norm.weight"]
        if cfg.tie_embeddings:
            if not embedding:
                plan["lm_head.weight"] = GLOBAL_NAMES["embed.weight"]
        else:
            plan["lm_head.weight"] = GLOBAL_NAMES["lm_head.weight"]
    return plan


def expected_shape(cfg: ModelConfig, ours: str) -> Tuple[int, ...]:
    """The shape of our parameter ``ours`` (Hugging Face's (out, in) for a matrix)."""
    key = ours.rsplit(".", 2)[-2] if "." in ours else ours
    d, h = cfg.dim, cfg.intermediate_size
    return {"embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "norm": (d,),
            "attn_norm": (d,), "mlp_norm": (d,), "wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d),
            "wv": (cfg.kv_dim, d), "wo": (d, cfg.q_dim), "gate": (h, d), "up": (h, d),
            "down": (d, h), "router": (cfg.n_experts, d)}[key]


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

    def close(self) -> None:
        pass
