"""From a prompt string to sampled text: tokenizer, model, and a way to run the blocks.

``LocalEngine`` runs every block in this process (``--nodes 1``); the ring engine
(``mdiedge.starter.RingEngine``) offers the same ``generate``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from ..model.checkpoint import load_config, load_model, resolve_model_path
from ..model.config import ModelConfig
from ..base.errors import ConfigError
from ..runtime.generation import Generation, Timing, TokenCallback, run_local
from ..model.sampling import SamplingParams
from ..model.tokenizer import Tokenizer, decode_continuation, load_tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def parse_device(name: str) -> torch.device:
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices")
    return device


@dataclass
class GenerationOutput:
    prompt: str
    prompt_ids: List[int]
    samples: List[Dict[str, Any]]
    timing: Timing

    def as_dict(self) -> Dict[str, Any]:
        return {"prompt": self.prompt, "prompt_tokens": len(self.prompt_ids),
                "samples": self.samples, "timing": self.timing.as_dict()}


class Engine:
    """Common part of the local and ring engines: config, tokenizer, prompt encoding."""

    cfg: ModelConfig
    tokenizer: Tokenizer

    def encode_prompt(self, prompt: str) -> List[int]:
        ids = self.tokenizer.encode(prompt) if prompt else []
        return ([self.cfg.bos_id] if self.cfg.bos_id is not None else []) + ids

    def new_generation(self, prompt: str, max_new_tokens: int, n_samples: int,
                       params: SamplingParams, on_token: Optional[TokenCallback]) -> Generation:
        return Generation(self.encode_prompt(prompt), n_samples, max_new_tokens, params,
                          self.cfg.eos_ids, self.cfg.max_seq_len, on_token)

    def output(self, prompt: str, generation: Generation, timing: Timing) -> GenerationOutput:
        samples = [{"index": s.index,
                    "text": decode_continuation(self.tokenizer, s.prompt, s.tokens),
                    "token_ids": s.tokens, "finish_reason": s.finish_reason}
                   for s in generation.samples]
        return GenerationOutput(prompt, generation.samples[0].prompt, samples, timing)


class LocalEngine(Engine):
    def __init__(self, model: Optional[Union[str, Path]] = None,
                 tokenizer: Optional[Union[str, Path]] = None, device: str = "cpu",
                 dtype: str = "float32") -> None:
        self.path = resolve_model_path(model)
        self.cfg = load_config(self.path)
        self.tokenizer = load_tokenizer(self.path, tokenizer)
        self.model = load_model(self.path, device=str(parse_device(device)),
                                dtype=parse_dtype(dtype))

    def generate(self, prompt: str, max_new_tokens: int, n_samples: int = 1,
                 params: SamplingParams = SamplingParams(), micro_batch: int = 0,
                 on_token: Optional[TokenCallback] = None) -> GenerationOutput:
        generation = self.new_generation(prompt, max_new_tokens, n_samples, params, on_token)
        timing = run_local(self.model, generation, micro_batch)
        return self.output(prompt, generation, timing)
