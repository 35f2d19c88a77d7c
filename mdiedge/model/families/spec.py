"""What a model family declares (``Family``): how its Hugging Face ``config.json`` (and, where
llama.cpp has it, its GGUF metadata) maps to ``ModelConfig``, its tensors' names, the block it
builds, and what the compiled decode step (``mdiedge.model._stepspec``) runs for it.

Torch-free, so that configs can be read where torch is not installed: a family's block is
built by a function that imports its torch module when called.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Tuple

if TYPE_CHECKING:
    from ..config import ModelConfig


@dataclass(frozen=True)
class Family:
    """One model family: a decoder whose blocks share one arithmetic.

    Names map our parameter names (``layers.{i}.`` stripped for a block's) to the checkpoint's
    (``model.layers.{i}.`` stripped for Hugging Face, ``blk.{i}.`` for GGUF); ``{e}`` in a
    name stands for each expert's index. ``step_blocks`` and ``step_head`` declare what the
    compiled step computes exactly as this family does: its block (RMSNorm, bias-free GQA
    with rotate-half RoPE, SwiGLU) and its head (RMSNorm, then a bias-free product). Where
    False, the model runs that part in torch, whatever the shapes.
    """

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
    make_block: Callable[["ModelConfig"], Any]  # a block (torch module) of this family
    step_blocks: bool
    step_head: bool

    def describe(self) -> str:
        """``name (model types)`` for error messages listing the known families."""
        return f"{self.name} ({', '.join(self.model_types)})"
