"""The Llama family: Llama 1-3 (SmolLM2, TinyLlama, NanoLlama, stories260K), and Mistral's dense
models (Touvron et al. 2023; Jiang et al. 2023): RMSNorm, GQA attention with rotate-half RoPE,
SwiGLU feed-forward, no biases. The compiled decode step is this block's arithmetic."""
from __future__ import annotations

from typing import Any, Dict

from .family import Family

# config.json key -> ModelConfig field, for every family built on Llama's config
HF_KEYS: Dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_seq_len",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
HF_DEFAULTS: Dict[str, Any] = {
    "num_key_value_heads": None,  # = num_attention_heads
    "head_dim": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
HF_REFUSED = ("attention_bias", "mlp_bias")
HF_WRITTEN: Dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

HF_GLOBAL_NAMES: Dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
HF_ATTENTION_NAMES: Dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
HF_BLOCK_NAMES: Dict[str, str] = dict(HF_ATTENTION_NAMES, **{
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
})

GGUF_GLOBAL_NAMES: Dict[str, str] = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_ATTENTION_NAMES: Dict[str, str] = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.wq.weight": "attn_q.weight",
    "attn.wk.weight": "attn_k.weight",
    "attn.wv.weight": "attn_v.weight",
    "attn.wo.weight": "attn_output.weight",
    "mlp_norm.weight": "ffn_norm.weight",
}
GGUF_BLOCK_NAMES: Dict[str, str] = dict(GGUF_ATTENTION_NAMES, **{
    "mlp.gate.weight": "ffn_gate.weight",
    "mlp.up.weight": "ffn_up.weight",
    "mlp.down.weight": "ffn_down.weight",
})


def make_block(cfg: Any, layer: int) -> Any:
    from ..block import Block
    from ..layers import MLP

    return Block(cfg, MLP(cfg.dim, cfg.intermediate_size))


FAMILY = Family(
    name="llama", model_types=("llama", "mistral"), hf_architecture="LlamaForCausalLM",
    hf_keys=HF_KEYS, hf_defaults=HF_DEFAULTS, hf_refused=HF_REFUSED, hf_written=HF_WRITTEN,
    hf_global_names=HF_GLOBAL_NAMES, hf_block_names=HF_BLOCK_NAMES,
    gguf_architectures=("llama",), gguf_global_names=GGUF_GLOBAL_NAMES,
    gguf_block_names=GGUF_BLOCK_NAMES, gguf_qk_permuted=True, moe=False,
    make_block=make_block, step_blocks=True, step_head=True)
