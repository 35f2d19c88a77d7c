"""Tensor sources that need no torch, reading numpy arrays (``get_array``; ``get`` wraps
them as tensors for the torch path): the llama2.c format (``Llama2cSource``, the default
model). GGUF's (``mdiedge.model.gguf.GGUFSource``) is torch-free too."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..base.errors import CheckpointError
from .modelfile import LLAMA2C_HEADER, llama2c_config
from .tensors import BLOCK_NAMES, GLOBAL_NAMES, TensorSource

if TYPE_CHECKING:
    from torch import Tensor


def _llama2c_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Interleaved RoPE rows -> "rotate half" rows, as Hugging Face's converter does."""
    rows, cols = w.shape
    grouped = w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(grouped).reshape(rows, cols)


class Llama2cSource(TensorSource):
    """A llama2.c "legacy" (version 0) checkpoint file, exposed under Hugging Face names."""

    HEADER = LLAMA2C_HEADER

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.cfg = llama2c_config(path)
        cfg = self.cfg
        d, h, n, kv, v = cfg.dim, cfg.intermediate_size, cfg.n_layers, cfg.kv_dim, cfg.vocab_size
        half_head = cfg.head_dim // 2
        layout: List[Tuple[str, Tuple[int, ...]]] = [
            ("embed", (v, d)), ("attn_norm", (n, d)), ("wq", (n, d, d)), ("wk", (n, kv, d)),
            ("wv", (n, kv, d)), ("wo", (n, d, d)), ("mlp_norm", (n, d)), ("gate", (n, h, d)),
            ("down", (n, d, h)), ("up", (n, h, d)), ("norm", (d,)),
            ("rope_real", (cfg.max_seq_len, half_head)), ("rope_imag", (cfg.max_seq_len, half_head)),
        ]
        if not cfg.tie_embeddings:
            layout.append(("lm_head", (v, d)))
        offset = self.HEADER.size
        self.arrays: Dict[str, Tuple[int, Tuple[int, ...]]] = {}
        for key, shape in layout:
            self.arrays[key] = (offset, shape)
            offset += 4 * int(np.prod(shape))
        size = path.stat().st_size
        if size < offset:
            raise CheckpointError(f"{path}: truncated llama2.c file ({size} bytes, the header "
                                  f"implies {offset})")
        self.map = np.memmap(path, dtype="<f4", mode="r")
        hf = {"embed": GLOBAL_NAMES["embed.weight"], "norm": GLOBAL_NAMES["norm.weight"],
              "lm_head": GLOBAL_NAMES["lm_head.weight"]}
        self.index: Dict[str, Tuple[str, Optional[int]]] = {
            name: (key, None) for key, name in hf.items() if key in self.arrays}
        per_layer = {"attn_norm": "attn_norm.weight", "wq": "attn.wq.weight",
                     "wk": "attn.wk.weight", "wv": "attn.wv.weight", "wo": "attn.wo.weight",
                     "mlp_norm": "mlp_norm.weight", "gate": "mlp.gate.weight",
                     "down": "mlp.down.weight", "up": "mlp.up.weight"}
        for key, ours in per_layer.items():
            for i in range(n):
                self.index[f"model.layers.{i}.{BLOCK_NAMES[ours]}"] = (key, i)

    def names(self) -> Sequence[str]:
        return list(self.index)

    def _read(self, name: str) -> Tensor:
        import torch

        return torch.from_numpy(self.read_array(name))

    def get_array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 numpy (``get``'s values)."""
        self.read_names.append(name)
        return self.read_array(name)

    def read_array(self, name: str) -> np.ndarray:
        key, layer = self.index[name]
        offset, shape = self.arrays[key]
        if layer is not None:
            shape = shape[1:]
            offset += 4 * layer * int(np.prod(shape))
        start = offset // 4
        count = int(np.prod(shape))
        t = np.array(self.map[start: start + count], dtype=np.float32).reshape(shape)
        if key == "wq":
            t = _llama2c_permute(t, self.cfg.n_heads)
        elif key == "wk":
            t = _llama2c_permute(t, self.cfg.n_kv_heads)
        return t
