"""The Mixtral family (Jiang et al. 2024): Llama's attention with a sparse mixture-of-experts
feed-forward (``mdiedge.model.moe``). In GGUF it is the ``llama`` architecture with experts. The
compiled step runs its blocks, the experts included, and its head."""
from __future__ import annotations

from typing import Any, Dict

from . import llama
from .family import Family

HF_KEYS: Dict[str, str] = dict(llama.HF_KEYS, num_local_experts="n_experts",
                               num_experts_per_tok="experts_per_token")
HF_DEFAULTS: Dict[str, Any] = dict(llama.HF_DEFAULTS, num_local_experts=0,
                                   num_experts_per_tok=0)
HF_BLOCK_NAMES: Dict[str, str] = dict(llama.HF_ATTENTION_NAMES, **{
    "mlp.router.weight": "block_sparse_moe.gate.weight",
    "mlp.experts.{e}.gate.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "mlp.experts.{e}.down.weight": "block_sparse_moe.experts.{e}.w2.weight",
    "mlp.experts.{e}.up.weight": "block_sparse_moe.experts.{e}.w3.weight",
})
GGUF_BLOCK_NAMES: Dict[str, str] = dict(llama.GGUF_ATTENTION_NAMES, **{
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.experts.{e}.gate.weight": "ffn_gate_exps.weight",  # (experts, rows, cols) stacked
    "mlp.experts.{e}.up.weight": "ffn_up_exps.weight",
    "mlp.experts.{e}.down.weight": "ffn_down_exps.weight",
})


def make_block(cfg: Any, layer: int) -> Any:
    from ..block import Block
    from ..moe import MoE

    return Block(cfg, MoE(cfg))


FAMILY = Family(
    name="mixtral", model_types=("mixtral",), hf_architecture="MixtralForCausalLM",
    hf_keys=HF_KEYS, hf_defaults=HF_DEFAULTS, hf_refused=llama.HF_REFUSED,
    hf_written=llama.HF_WRITTEN, hf_global_names=llama.HF_GLOBAL_NAMES,
    hf_block_names=HF_BLOCK_NAMES, gguf_architectures=("llama",),
    gguf_global_names=llama.GGUF_GLOBAL_NAMES, gguf_block_names=GGUF_BLOCK_NAMES,
    gguf_qk_permuted=True, moe=True, make_block=make_block, step_blocks=True,
    step_head=True)
