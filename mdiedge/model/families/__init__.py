"""Model families: one module per family (``llama``, ``mixtral``, ``qwen2``, ``qwen3``,
``qwen3_moe``, ``gemma3``), each declaring a ``Family`` (``family``): its config mapping, tensor
names, block, arithmetic features and what the compiled decode step runs for it. This registry finds
a model's family, by ``config.json``'s ``model_type``, by a GGUF file's architecture, or by a
``ModelConfig``, and maps configs both ways.

A new family is a module here that builds a ``Family``, listed in ``FAMILIES``. Torch-free (configs
are read where torch is not installed); imports only ``..config``."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from ...base.errors import ConfigError
from ..config import ModelConfig, config_from_keys, keys_of_config
from . import gemma3, llama, mixtral, qwen2, qwen3, qwen3_moe
from .family import Family

FAMILIES: Dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mixtral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, gemma3.FAMILY)}


def _known() -> str:
    return ", ".join(f.describe() for f in FAMILIES.values())


def by_model_type(model_type: Any, source: str = "model config") -> Family:
    """The family reading ``config.json``'s ``model_type``; ConfigError naming it and the
    known families."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ConfigError(f"{source}: unsupported model_type {model_type!r} (known families: "
                      f"{_known()})")


def by_gguf_architecture(arch: Any, moe: bool, source: str) -> Family:
    """The family reading GGUF files of ``general.architecture`` ``arch``, dense or with
    experts (``moe``); ConfigError naming it and the families known in GGUF."""
    found = [f for f in FAMILIES.values() if arch in f.gguf_architectures]
    for family in found:
        if family.moe == moe:
            return family
    if found:
        raise ConfigError(f"{source}: architecture {arch!r} {'with' if moe else 'without'} "
                          f"experts is not supported")
    archs = sorted({a for f in FAMILIES.values() for a in f.gguf_architectures})
    raise ConfigError(f"{source}: unsupported architecture {arch!r} (supported: "
                      f"{', '.join(archs)}; known families: {_known()})")


def family_of(cfg: ModelConfig) -> Family:
    """The family of ``cfg`` (by its ``model_type``), checked to fit it: experts exactly in a
    mixture-of-experts family."""
    family = by_model_type(cfg.model_type)
    if cfg.is_moe != family.moe:
        raise ConfigError(f"model config: model_type {cfg.model_type!r} is "
                          f"{'a mixture of experts' if family.moe else 'dense'}, but "
                          f"n_experts={cfg.n_experts}")
    return family


def config_from_hf(raw: Mapping[str, Any], source: str = "config.json",
                   generation: Optional[Mapping[str, Any]] = None,
                   generation_source: str = "generation_config.json") -> ModelConfig:
    """Map a Hugging Face ``config.json`` dict (and ``generation_config.json``) to ModelConfig
    by its family's declaration; any value of the wrong kind is a one-line ConfigError naming
    ``source``."""
    family = by_model_type(raw.get("model_type"), source)
    for flag in family.hf_refused:
        if raw.get(flag):
            raise ConfigError(f"{source}: {flag}=true is not supported")
    cfg = config_from_keys(raw, source, generation, generation_source, family.hf_keys,
                           family.hf_defaults, family.hf_extra)
    try:
        family_of(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {str(e).partition(': ')[2]}") from None
    return cfg


def config_to_hf(cfg: ModelConfig) -> Dict[str, Any]:
    """Inverse of :func:`config_from_hf`, for the checkpoints mdiedge writes and the config a
    starter sends its workers."""
    family = family_of(cfg)
    out: Dict[str, Any] = {"architectures": [family.hf_architecture],
                           "model_type": cfg.model_type}
    out.update(family.hf_written)
    out.update(keys_of_config(cfg, family.hf_keys))
    if family.hf_extra_written is not None:
        out.update(family.hf_extra_written(cfg))
    return out


def known_names() -> Tuple[str, ...]:
    return tuple(FAMILIES)
