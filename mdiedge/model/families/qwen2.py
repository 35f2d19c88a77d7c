"""The Qwen2 family (Qwen2 / Qwen2.5, Yang et al. 2024): Llama's block with a bias on the Q, K and V
projections, which the compiled decode step adds (``BlockWeights.qkv_bias``)."""
from __future__ import annotations

from typing import Any, Dict

from . import llama
from .family import Family

HF_BLOCK_NAMES: Dict[str, str] = dict(llama.HF_BLOCK_NAMES, **{
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
})
GGUF_BLOCK_NAMES: Dict[str, str] = dict(llama.GGUF_BLOCK_NAMES, **{
    "attn.wq.bias": "attn_q.bias",
    "attn.wk.bias": "attn_k.bias",
    "attn.wv.bias": "attn_v.bias",
})


def make_block(cfg: Any, layer: int) -> Any:
    from ..block import Block
    from ..layers import MLP

    return Block(cfg, MLP(cfg.dim, cfg.intermediate_size), qkv_bias=True)


FAMILY = Family(
    name="qwen2", model_types=("qwen2",), hf_architecture="Qwen2ForCausalLM",
    hf_keys=llama.HF_KEYS, hf_defaults=llama.HF_DEFAULTS, hf_refused=(),
    hf_written={"hidden_act": "silu", "use_sliding_window": False},
    hf_global_names=llama.HF_GLOBAL_NAMES, hf_block_names=HF_BLOCK_NAMES,
    gguf_architectures=("qwen2",), gguf_global_names=llama.GGUF_GLOBAL_NAMES,
    gguf_block_names=GGUF_BLOCK_NAMES, gguf_qk_permuted=False, moe=False,
    make_block=make_block, step_blocks=True, step_head=True)
