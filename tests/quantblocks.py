"""Random valid blocks of any type of ``mdiedge.model.quant.TYPES`` for the quantized kernels'
tests: random quant bytes, each block's f16 scales (F16's and BF16's every value) set to
finite numbers of either sign and of size ``low`` .. ``high``."""
from __future__ import annotations

import numpy as np
import torch

from mdiedge.model import quant


def sized(rng: np.random.Generator, count: int, low: float, high: float) -> np.ndarray:
    """``count`` float32 values of either sign and of size ``low`` .. ``high``, (count, 1)."""
    size = rng.uniform(low, high, (count, 1))
    return (size * rng.choice([-1, 1], (count, 1))).astype(np.float32)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0, low: float = 0.001,
                  high: float = 0.05) -> torch.Tensor:
    """uint8 (n, row_bytes) of ``qtype``."""
    rng = np.random.default_rng(seed)
    t = quant.TYPES[qtype]
    if t.block == 1:
        values = sized(rng, n * k, low, high).reshape(n, k)
        if qtype == "F16":
            raw = values.astype(np.float16).view(np.uint8)
        elif qtype == "BF16":
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = values.view(np.uint8)
        return torch.from_numpy(np.ascontiguousarray(raw))
    raw = rng.integers(0, 256, (n, quant.row_bytes(qtype, k)), dtype=np.uint8)
    per_block = raw.reshape(-1, t.block_bytes)
    for at in t.scales:
        scale = sized(rng, per_block.shape[0], low, high)
        per_block[:, at:at + 2] = scale.astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw)
