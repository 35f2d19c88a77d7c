"""Model configuration: one dataclass, named presets, and a Hugging Face ``config.json`` read by
each family's table of keys (``families``). Derived values (``head_dim``, ``kv_dim``, counts) are
computed here and nowhere else."""
from __future__ import annotations

import dataclasses
import json
import math
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..base.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """The ``llama3`` frequency scaling of Llama 3.1+ (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_seq_len: int = 2048
    head_dim: int = 0  # 0: dim // n_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    tie_embeddings: bool = False
    n_experts: int = 0  # 0: dense MLP in every block
    experts_per_token: int = 0
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to one
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    sliding_layers: Tuple[int, ...] = ()  # the blocks attending through the window
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers; 0: rope_theta
    query_pre_attn_scalar: float = 0.0  # attention scores scaled by its -1/2 power; 0: head_dim
    bos_id: Optional[int] = 1
    eos_ids: Tuple[int, ...] = (2,)
    model_type: str = "llama"  # the family's (``mdiedge.model.families``)
    name: str = "custom"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                    "intermediate_size", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model config: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"model config: dim={self.dim} is not divisible by n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ConfigError(
                f"model config: experts_per_token={self.experts_per_token} must be in "
                f"1..n_experts={self.n_experts}")
        self._check_windows()
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ConfigError(f"model config: model_type must be a name, got "
                              f"{self.model_type!r}")
        self._check_numbers()

    def _check_windows(self) -> None:
        if isinstance(self.sliding_layers, list):
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        layers = self.sliding_layers
        if not isinstance(layers, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) for i in layers) \
                or list(layers) != sorted(set(layers)) \
                or not all(0 <= i < self.n_layers for i in layers):
            raise ConfigError(f"model config: sliding_layers must be ascending block indices "
                              f"in 0..{self.n_layers - 1}, got {layers!r}"[:300])
        window = self.sliding_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0 \
                or (layers and not window):
            raise ConfigError(f"model config: sliding_window must be a positive integer where "
                              f"layers slide, got {window!r}")

    def _check_numbers(self) -> None:
        numbers = {"rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta}
        numbers.update({k: v for k, v in (("rope_local_theta", self.rope_local_theta),
                                          ("query_pre_attn_scalar", self.query_pre_attn_scalar))
                        if v != 0})
        if self.rope_scaling is not None:
            numbers.update({f"rope_scaling.{k}": v
                            for k, v in dataclasses.asdict(self.rope_scaling).items()})
        for key, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive finite number, "
                                  f"got {value!r}")
        ids = [("bos_token_id", self.bos_id)] if self.bos_id is not None else []
        ids += [("eos_token_id", i) for i in self.eos_ids]
        for key, value in ids:
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not 0 <= value < self.vocab_size:
                raise ConfigError(f"model config: {key} {value!r} is not a token of the "
                                  f"vocabulary (0..{self.vocab_size - 1})")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def block_params(self) -> int:
        attn = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim
        mlp = 3 * self.dim * self.intermediate_size
        if self.is_moe:
            mlp = mlp * self.n_experts + self.n_experts * self.dim
        return attn + mlp + 2 * self.dim

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    def head_params(self) -> int:
        """Final norm and output projection (shared with a tied embedding)."""
        return self.dim + (0 if self.tie_embeddings else self.vocab_size * self.dim)

    def n_params(self) -> int:
        return self.embedding_params() + self.n_layers * self.block_params() + self.head_params()

    def kv_bytes_per_token_per_layer(self, itemsize: int = 4) -> int:
        return 2 * self.kv_dim * itemsize

    def replace(self, **changes: Any) -> "ModelConfig":
        if "head_dim" not in changes and ("dim" in changes or "n_heads" in changes):
            changes["head_dim"] = 0
        return dataclasses.replace(self, **changes)


PRESETS: Dict[str, ModelConfig] = {
    "nanollama": ModelConfig(
        name="nanollama", vocab_size=2048, dim=256, n_layers=12, n_heads=8, n_kv_heads=2,
        intermediate_size=688, max_seq_len=1024, tie_embeddings=True, bos_id=1, eos_ids=(2,)),
    "nanollama-304m": ModelConfig(
        name="nanollama-304m", vocab_size=32000, dim=1024, n_layers=12, n_heads=16,
        n_kv_heads=4, intermediate_size=5632, max_seq_len=2048),
    "stories260k": ModelConfig(
        name="stories260k", vocab_size=512, dim=64, n_layers=5, n_heads=8, n_kv_heads=4,
        intermediate_size=172, max_seq_len=512, tie_embeddings=True),
    "tinyllama-1.1b": ModelConfig(
        name="tinyllama-1.1b", vocab_size=32000, dim=2048, n_layers=22, n_heads=32,
        n_kv_heads=4, intermediate_size=5632, max_seq_len=2048),
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", vocab_size=128256, dim=2048, n_layers=16, n_heads=32,
        n_kv_heads=8, intermediate_size=8192, max_seq_len=131072, rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_embeddings=True,
        bos_id=128000, eos_ids=(128001, 128008, 128009)),
    "tinymistral-6x248m": ModelConfig(
        name="tinymistral-6x248m", model_type="mixtral", vocab_size=32005, dim=1024,
        n_layers=12, n_heads=32, n_kv_heads=8, intermediate_size=4096, max_seq_len=32768,
        n_experts=6, experts_per_token=2),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


def _rope_from_hf(raw: Mapping[str, Any], source: str) -> Tuple[float, Optional[RopeScaling]]:
    """transformers 4's ``rope_theta`` + ``rope_scaling``, or 5's ``rope_parameters``."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling: Optional[Mapping[str, Any]] = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: unsupported rope type {rope_type!r} "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{source}: llama3 rope scaling lacks key {e.args[0]!r}") from None


def _token_ids(value: Any, key: str, source: str) -> Tuple[int, ...]:
    if value is None:
        return ()
    found = value if isinstance(value, list) else [value]
    for v in found:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{source}: {key} must be a token id (an integer) or a list of "
                              f"them, got {value!r}"[:300])
    return tuple(found)


def _special_ids(raw: Mapping[str, Any], gen: Mapping[str, Any], source: str,
                 generation_source: str, vocab_size: Any) -> Tuple[Optional[int], Tuple[int, ...]]:
    """``generation_config.json``'s over ``config.json``'s, each in the vocabulary (errors name the
    file)."""
    found = {}
    for key in ("bos_token_id", "eos_token_id"):
        which = generation_source if key in gen else source
        ids = _token_ids(gen.get(key, raw.get(key)), key, which)
        if key == "bos_token_id" and len(ids) > 1:
            raise ConfigError(f"{which}: {key} must be one token id, got {list(ids)}")
        for i in ids:
            if isinstance(vocab_size, int) and not 0 <= i < vocab_size:
                raise ConfigError(f"{which}: {key} {i} is not a token of the vocabulary "
                                  f"(0..{vocab_size - 1})")
        found[key] = ids
    bos = found["bos_token_id"]
    return (bos[0] if bos else None), found["eos_token_id"]


def config_from_keys(raw: Mapping[str, Any], source: str,
                     generation: Optional[Mapping[str, Any]], generation_source: str,
                     keys: Mapping[str, str], defaults: Mapping[str, Any],
                     extra: Optional[Callable[[Mapping[str, Any], str], Dict[str, Any]]] = None
                     ) -> ModelConfig:
    """``keys`` maps config.json keys to fields, required unless in ``defaults`` (None: the field's
    default); RoPE, special tokens and window are read alike for every family unless its ``extra``
    returns replacements. A wrong value is a one-line ConfigError naming ``source``."""
    try:
        return _config_from_keys(raw, source, generation, generation_source, keys, defaults,
                                 extra)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ConfigError(f"{source}: a value of the wrong kind ({type(e).__name__}: "
                          f"{e})"[:300]) from None


def _config_from_keys(raw: Mapping[str, Any], source: str,
                      generation: Optional[Mapping[str, Any]], generation_source: str,
                      keys: Mapping[str, str], defaults: Mapping[str, Any],
                      extra: Optional[Callable[[Mapping[str, Any], str], Dict[str, Any]]]
                      ) -> ModelConfig:
    values: Dict[str, Any] = {}
    for hf_key, ours in keys.items():
        if hf_key in raw and raw[hf_key] is not None:
            values[ours] = raw[hf_key]
        elif hf_key in defaults:
            if defaults[hf_key] is not None:
                values[ours] = defaults[hf_key]
        else:
            raise ConfigError(f"{source}: missing required key {hf_key!r}")
    values.setdefault("n_kv_heads", values["n_heads"])
    values.setdefault("head_dim", 0)
    own = extra(raw, source) if extra is not None else {}
    window = None if "sliding_window" in own else raw.get("sliding_window")
    if window is not None and raw.get("use_sliding_window", True) \
            and window < values["max_seq_len"]:
        values["max_seq_len"] = int(window)  # a window on every layer: the context is capped
    if "rope_theta" not in own:
        values["rope_theta"], values["rope_scaling"] = _rope_from_hf(raw, source)
    values.update(own)
    values["bos_id"], values["eos_ids"] = _special_ids(raw, generation or {}, source,
                                                       generation_source, values["vocab_size"])
    values["model_type"] = raw["model_type"]
    values["name"] = str(raw.get("_name_or_path") or source)
    for key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(values[key], (int, float)):
            raise ConfigError(f"{source}: {key} must be a number, got {values[key]!r}")
    try:
        return ModelConfig(**values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from None


def keys_of_config(cfg: ModelConfig, keys: Mapping[str, str]) -> Dict[str, Any]:
    """Inverse of :func:`config_from_keys`, with RoPE, special tokens and the dtype we write."""
    out: Dict[str, Any] = {
        "torch_dtype": "float32",
        "rope_theta": cfg.rope_theta,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_ids[0] if len(cfg.eos_ids) == 1 else list(cfg.eos_ids),
    }
    for hf_key, ours in keys.items():
        out[hf_key] = getattr(cfg, ours)
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(dataclasses.asdict(cfg.rope_scaling), rope_type="llama3")
    return out


MAX_JSON_BYTES = 64 << 20  # a model's JSON file (config, generation config, index)


def read_json(path: Path) -> Dict[str, Any]:
    """At most ``MAX_JSON_BYTES`` from a regular file (never a FIFO or device), or a one-line
    ConfigError (not UTF-8, too deep)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: not a regular file")
    if info.st_size > MAX_JSON_BYTES:
        raise ConfigError(f"{path}: {info.st_size} bytes, more than a model's JSON file may "
                          f"hold ({MAX_JSON_BYTES})")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(MAX_JSON_BYTES + 1).decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a JSON file (not UTF-8 text: byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
