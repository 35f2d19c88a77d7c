"""The Qwen3 family (dense Qwen3, Yang et al. 2025): Llama's block without biases, with an RMSNorm
over each head of Q and K before RoPE, and a head size of its own (``head_dim``, not always ``dim /
heads``)."""
from __future__ import annotations

from typing import Any, Dict

from . import llama
from .family import Family

HF_ATTENTION_NAMES: Dict[str, str] = dict(llama.HF_ATTENTION_NAMES, **{
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
})
GGUF_ATTENTION_NAMES: Dict[str, str] = dict(llama.GGUF_ATTENTION_NAMES, **{
    "attn.q_norm.weight": "attn_q_norm.weight",
    "attn.k_norm.weight": "attn_k_norm.weight",
})
HF_BLOCK_NAMES: Dict[str, str] = dict(HF_ATTENTION_NAMES, **{
    k: v for k, v in llama.HF_BLOCK_NAMES.items() if k.startswith("mlp.")})
GGUF_BLOCK_NAMES: Dict[str, str] = dict(GGUF_ATTENTION_NAMES, **{
    k: v for k, v in llama.GGUF_BLOCK_NAMES.items() if k.startswith("mlp.")})
HF_WRITTEN: Dict[str, Any] = {"hidden_act": "silu", "attention_bias": False,
                              "use_sliding_window": False}


def make_block(cfg: Any, layer: int) -> Any:
    from ..block import Block
    from ..layers import MLP

    return Block(cfg, MLP(cfg.dim, cfg.intermediate_size), qk_norm=FAMILY.qk_norm)


FAMILY = Family(
    name="qwen3", model_types=("qwen3",), hf_architecture="Qwen3ForCausalLM",
    hf_keys=llama.HF_KEYS, hf_defaults=llama.HF_DEFAULTS, hf_refused=llama.HF_REFUSED,
    hf_written=HF_WRITTEN, hf_global_names=llama.HF_GLOBAL_NAMES,
    hf_block_names=HF_BLOCK_NAMES, gguf_architectures=("qwen3",),
    gguf_global_names=llama.GGUF_GLOBAL_NAMES, gguf_block_names=GGUF_BLOCK_NAMES,
    gguf_qk_permuted=False, moe=False, make_block=make_block, step_blocks=True,
    step_head=True, qk_norm=True)
