"""The Qwen3-MoE family (Qwen3-30B-A3B and kin, Yang et al. 2025): Qwen3's attention (Q/K head
norms) with a sparse mixture-of-experts feed-forward in every block (``mdiedge.model.moe``): a
softmax over the experts, the top k kept, renormalised where ``norm_topk_prob`` says so (llama.cpp's
``qwen3moe`` always does)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping

from ...base.errors import ConfigError
from . import llama, qwen3
from .family import Family

HF_KEYS: Dict[str, str] = dict({k: v for k, v in llama.HF_KEYS.items()
                                if k != "intermediate_size"},
                               moe_intermediate_size="intermediate_size",
                               num_local_experts="n_experts",
                               num_experts_per_tok="experts_per_token",
                               norm_topk_prob="norm_topk_prob")
HF_DEFAULTS: Dict[str, Any] = dict(llama.HF_DEFAULTS, num_local_experts=None,
                                   num_experts_per_tok=0, norm_topk_prob=False)
HF_BLOCK_NAMES: Dict[str, str] = dict(qwen3.HF_ATTENTION_NAMES, **{
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.{e}.gate.weight": "mlp.experts.{e}.gate_proj.weight",
    "mlp.experts.{e}.up.weight": "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down.weight": "mlp.experts.{e}.down_proj.weight",
})
GGUF_BLOCK_NAMES: Dict[str, str] = dict(qwen3.GGUF_ATTENTION_NAMES, **{
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.experts.{e}.gate.weight": "ffn_gate_exps.weight",
    "mlp.experts.{e}.up.weight": "ffn_up_exps.weight",
    "mlp.experts.{e}.down.weight": "ffn_down_exps.weight",
})


def hf_extra(raw: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """The experts' count under either name (``num_experts``, or transformers 5's
    ``num_local_experts``); experts in every block, or a one-line ConfigError."""
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{source}: dense blocks among the experts' (mlp_only_layers "
                          f"{raw.get('mlp_only_layers')!r}, decoder_sparse_step "
                          f"{raw.get('decoder_sparse_step')!r}) are not supported"[:300])
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    return {"n_experts": 0 if experts is None else experts}


def gguf_extra(get: Callable[..., Any]) -> Dict[str, Any]:
    """llama.cpp's ``qwen3moe`` renormalises the top k's weights, whatever the metadata."""
    return {"moe_intermediate_size": get("expert_feed_forward_length"), "norm_topk_prob": True}


def make_block(cfg: Any, layer: int) -> Any:
    from ..block import Block
    from ..moe import MoE

    return Block(cfg, MoE(cfg), qk_norm=FAMILY.qk_norm)


FAMILY = Family(
    name="qwen3_moe", model_types=("qwen3_moe",), hf_architecture="Qwen3MoeForCausalLM",
    hf_keys=HF_KEYS, hf_defaults=HF_DEFAULTS, hf_refused=llama.HF_REFUSED,
    hf_written=qwen3.HF_WRITTEN, hf_global_names=llama.HF_GLOBAL_NAMES,
    hf_block_names=HF_BLOCK_NAMES, gguf_architectures=("qwen3moe",),
    gguf_global_names=llama.GGUF_GLOBAL_NAMES, gguf_block_names=GGUF_BLOCK_NAMES,
    gguf_qk_permuted=False, moe=True, make_block=make_block, step_blocks=True,
    step_head=True, qk_norm=True, hf_extra=hf_extra, gguf_extra=gguf_extra)
