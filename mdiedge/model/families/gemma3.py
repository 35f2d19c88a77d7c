"""The Gemma 3 family, its text decoder (Gemma3ForCausalLM; Gemma Team 2025): embeddings scaled by
sqrt(dim), RMSNorm multiplying by (1 + w) (llama.cpp's converter stores 1 + w; a Hugging Face
checkpoint's w gets its 1 at load: ``norm_offset``), "sandwich" norms (the attention's and the
feed-forward's outputs normed too, before their residual adds), Q/K head norms, GeGLU with
tanh-GELU, attention scaled by ``query_pre_attn_scalar ** -0.5``, and sliding-window layers with
their own RoPE base among global ones (every 6th by default)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping

from ...base.errors import ConfigError
from ..config import ModelConfig
from . import llama, qwen3
from .family import Family

ACTIVATION = "gelu_pytorch_tanh"  # config.json's name for tanh-GELU
SLIDING, GLOBAL = "sliding_attention", "full_attention"
DEFAULT_THETA, DEFAULT_LOCAL_THETA, DEFAULT_PATTERN = 1_000_000.0, 10_000.0, 6

HF_KEYS: Dict[str, str] = dict(llama.HF_KEYS, query_pre_attn_scalar="query_pre_attn_scalar")
HF_DEFAULTS: Dict[str, Any] = dict(llama.HF_DEFAULTS, head_dim=256, tie_word_embeddings=True,
                                   query_pre_attn_scalar=256)
HF_BLOCK_NAMES: Dict[str, str] = dict(qwen3.HF_ATTENTION_NAMES, **{
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp_norm.weight": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
})
GGUF_BLOCK_NAMES: Dict[str, str] = dict(qwen3.GGUF_ATTENTION_NAMES, **{
    "post_attn_norm.weight": "post_attention_norm.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "post_mlp_norm.weight": "post_ffw_norm.weight",
    "mlp.gate.weight": "ffn_gate.weight",
    "mlp.up.weight": "ffn_up.weight",
    "mlp.down.weight": "ffn_down.weight",
})


def _layer_types(raw: Mapping[str, Any], source: str) -> List[str]:
    """Each block's attention, from ``layer_types`` or else ``sliding_window_pattern``."""
    n_layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", DEFAULT_PATTERN)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise ConfigError(f"{source}: sliding_window_pattern must be a positive integer, "
                              f"got {pattern!r}")
        return [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers \
            or not set(types) <= {SLIDING, GLOBAL}:
        raise ConfigError(f"{source}: layer_types must list {SLIDING!r} or {GLOBAL!r} for each "
                          f"of the {n_layers} blocks, got {types!r}"[:300])
    return types


def _rope(raw: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """Global and local RoPE bases from either layout (transformers 5's ``rope_parameters``
    per layer type, or ``rope_theta`` and ``rope_local_base_freq``); scaling is refused."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and (GLOBAL in params or SLIDING in params):
        full, local = params.get(GLOBAL) or {}, params.get(SLIDING) or {}
        theta = full.get("rope_theta", DEFAULT_THETA)
        local_theta = local.get("rope_theta", DEFAULT_LOCAL_THETA)
        scalings = [full, local]
    else:
        theta = raw.get("rope_theta", DEFAULT_THETA)
        local_theta = raw.get("rope_local_base_freq", DEFAULT_LOCAL_THETA)
        scalings = [raw.get("rope_scaling") or {}, params or {}]
    for scaling in scalings:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"{source}: unsupported rope type {kind!r} for Gemma 3 "
                              f"(supported: default)")
    return {"rope_theta": float(theta), "rope_scaling": None,
            "rope_local_theta": float(local_theta)}


def hf_extra(raw: Mapping[str, Any], source: str) -> Dict[str, Any]:
    activation = raw.get("hidden_activation", ACTIVATION)
    if activation != ACTIVATION:
        raise ConfigError(f"{source}: hidden_activation {activation!r} is not supported "
                          f"(Gemma 3: {ACTIVATION!r})")
    if raw.get("final_logit_softcapping") is not None:
        raise ConfigError(f"{source}: final_logit_softcapping="
                          f"{raw['final_logit_softcapping']!r} is not supported")
    window = raw.get("sliding_window") or 0
    types = _layer_types(raw, source)
    sliding = tuple(i for i, kind in enumerate(types) if kind == SLIDING) if window else ()
    return dict(_rope(raw, source), sliding_window=window, sliding_layers=sliding)


def hf_extra_written(cfg: ModelConfig) -> Dict[str, Any]:
    return {"hidden_activation": ACTIVATION, "final_logit_softcapping": None,
            "sliding_window": cfg.sliding_window or None,
            "layer_types": [SLIDING if i in cfg.sliding_layers else GLOBAL
                            for i in range(cfg.n_layers)],
            "rope_local_base_freq": cfg.rope_local_theta or cfg.rope_theta}


def gguf_extra(get: Callable[..., Any]) -> Dict[str, Any]:
    """What llama.cpp's ``gemma3`` takes as given: every 6th block global, a local RoPE base of
    10000, scores scaled by head_dim ** -0.5 (by (dim / heads) ** -0.5 for the 62-block 27B)."""
    heads, dim = get("attention.head_count"), get("embedding_length")
    scalar = get("attention.key_length")
    if get("block_count") == 62 and isinstance(dim, int) and isinstance(heads, int) and heads:
        scalar = dim // heads
    return {"sliding_window": get("attention.sliding_window"),
            "sliding_window_pattern": DEFAULT_PATTERN, "rope_local_base_freq": DEFAULT_LOCAL_THETA,
            "query_pre_attn_scalar": scalar}


def make_block(cfg: Any, layer: int) -> Any:
    from ..block import Block
    from ..layers import MLP

    window = cfg.sliding_window if layer in cfg.sliding_layers else 0
    return Block(cfg, MLP(cfg.dim, cfg.intermediate_size, FAMILY.activation),
                 qk_norm=FAMILY.qk_norm, sandwich_norms=FAMILY.sandwich_norms, window=window)


FAMILY = Family(
    name="gemma3", model_types=("gemma3_text",), hf_architecture="Gemma3ForCausalLM",
    hf_keys=HF_KEYS, hf_defaults=HF_DEFAULTS,
    hf_refused=("attention_bias", "use_bidirectional_attention"),
    hf_written={"attention_bias": False}, hf_global_names=llama.HF_GLOBAL_NAMES,
    hf_block_names=HF_BLOCK_NAMES, gguf_architectures=("gemma3",),
    gguf_global_names=llama.GGUF_GLOBAL_NAMES, gguf_block_names=GGUF_BLOCK_NAMES,
    gguf_qk_permuted=False, moe=False, make_block=make_block, step_blocks=True,
    step_head=True, qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
    embed_scaled=True, norm_offset=1.0, hf_extra=hf_extra,
    hf_extra_written=hf_extra_written, gguf_extra=gguf_extra)
