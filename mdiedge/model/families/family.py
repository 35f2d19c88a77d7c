"""What a model family declares: how its ``config.json`` (and GGUF metadata) maps to
``ModelConfig``, its tensors' names, the block it builds, what the compiled decode step runs for it.
Torch-free: a family's block is built by a function that imports torch when called."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:
    from ..config import ModelConfig


@dataclass(frozen=True)
class Family:
    """Names map ours (``layers.{i}.`` stripped) to the checkpoint's (``model.layers.{i}.``,
    ``blk.{i}.`` for GGUF); ``{e}`` stands for each expert's index. ``step_blocks`` and
    ``step_head`` declare what the compiled step computes exactly as this family does; where False
    that part runs in torch and says so (``decoderoute``).

    The fields after them declare the block's arithmetic beyond Llama's; what a config decides
    (sliding layers, RoPE bases, attention scale) is in ``ModelConfig``, read by ``hf_extra`` /
    ``gguf_extra`` where the generic keys do not say it, written back by ``hf_extra_written``."""

    name: str
    model_types: Tuple[str, ...]  # config.json ``model_type`` values it reads
    hf_architecture: str  # config.json ``architectures`` written for it
    hf_keys: Mapping[str, str]  # config.json key -> ModelConfig field; required unless defaulted
    hf_defaults: Mapping[str, Any]  # config.json key -> value when absent (None: the field's)
    hf_refused: Tuple[str, ...]  # config.json flags that must not be true
    hf_written: Mapping[str, Any]  # constant keys written into the config.json we write
    hf_global_names: Mapping[str, str]
    hf_block_names: Mapping[str, str]
    gguf_architectures: Tuple[str, ...]  # GGUF ``general.architecture`` values it reads
    gguf_global_names: Mapping[str, str]
    gguf_block_names: Mapping[str, str]
    gguf_qk_permuted: bool  # llama.cpp's converter stores Q and K rows in its RoPE order
    moe: bool  # blocks are mixtures of experts (``n_experts`` > 0), else dense
    make_block: Callable[["ModelConfig", int], Any]  # block ``layer`` (a torch module)
    step_blocks: bool
    step_head: bool
    qk_norm: bool = False  # RMSNorm over each head of Q and K, before RoPE
    sandwich_norms: bool = False  # RMSNorm of the attention's and feed-forward's outputs too
    activation: str = "silu"  # of the gated feed-forward: "silu" (SwiGLU), "gelu_tanh" (GeGLU)
    embed_scaled: bool = False  # embeddings times sqrt(dim), rounded to the weights' dtype
    norm_offset: float = 0.0  # a checkpoint's RMSNorm weight w multiplies by (norm_offset + w)
    hf_extra: Optional[Callable[[Mapping[str, Any], str], Dict[str, Any]]] = None  # fields
    hf_extra_written: Optional[Callable[["ModelConfig"], Dict[str, Any]]] = None
    gguf_extra: Optional[Callable[[Callable[..., Any]], Dict[str, Any]]] = None  # by get(key)

    def describe(self) -> str:
        """``name (model types)``, for error messages."""
        return f"{self.name} ({', '.join(self.model_types)})"
