"""Model config mapping from Hugging Face config.json (no torch needed: runs on Python 3.8 CI)."""
from __future__ import annotations

from typing import Any, Dict

import pytest

from mdiedge.model.config import PRESETS, ModelConfig, preset
from mdiedge.model.families import config_from_hf, config_to_hf
from mdiedge.base.errors import ConfigError

BASE: Dict[str, Any] = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.mark.parametrize("extra,field,value", [
    ({}, "head_dim", 16),
    ({"head_dim": 32}, "head_dim", 32),
    ({"num_key_value_heads": None}, "n_kv_heads", 4),
    ({"tie_word_embeddings": True}, "tie_embeddings", True),
    ({"rope_theta": 5e5}, "rope_theta", 5e5),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta", 1e6),
    ({"eos_token_id": [2, 7]}, "eos_ids", (2, 7)),
    ({"sliding_window": 128, "model_type": "mistral"}, "max_seq_len", 128),
    ({"sliding_window": None, "model_type": "mistral"}, "max_seq_len", 256),
])
def test_hf_mapping(extra: Dict[str, Any], field: str, value: Any) -> None:
    assert getattr(config_from_hf(dict(BASE, **extra)), field) == value


def test_llama3_scaling_in_both_layouts() -> None:
    scaling = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = config_from_hf(dict(BASE, rope_theta=5e5, rope_scaling=dict(scaling, rope_type="llama3")))
    v5 = config_from_hf(dict(BASE, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5)))
    assert v4 == v5 and v4.rope_scaling is not None and v4.rope_scaling.factor == 32.0


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, "config.json: unsupported model_type 'gpt2'"),
    ({"hidden_size": None}, "config.json: missing required key 'hidden_size'"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5}, "dim=64 is not divisible by n_heads=5"),
    ({"num_key_value_heads": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "lacks key 'low_freq_factor'"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"vocab_size": "100"}, "vocab_size must be a positive integer, got '100'"),
])
def test_bad_configs(change: Dict[str, Any], message: str) -> None:
    raw = dict(BASE, **change)
    raw = {k: v for k, v in raw.items() if v is not None or k != "hidden_size"}
    with pytest.raises(ConfigError) as e:
        config_from_hf(raw)
    assert message in str(e.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf(name: str) -> None:
    cfg = preset(name)
    back = config_from_hf(config_to_hf(cfg))
    assert back.replace(name=cfg.name) == cfg


def test_derived_values() -> None:
    cfg = ModelConfig(vocab_size=10, dim=64, n_layers=2, n_heads=8, n_kv_heads=2,
                      intermediate_size=100)
    assert (cfg.head_dim, cfg.kv_dim, cfg.q_dim) == (8, 16, 64)
    assert cfg.n_params() == 10 * 64 * 2 + 2 * cfg.block_params() + 64
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        preset("nope")
