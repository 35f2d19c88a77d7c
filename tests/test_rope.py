"""RoPE tables computed as positions are reached (``rope.GrowingRope``): every row equal, bit
for bit, to the whole table's (``rope_tables``, the torch model's), however the rows grow;
nothing computed past what was asked; and a CPU model with a long context holds its tables'
memory only where its tokens went (tests/test_cpumodel.py)."""
from __future__ import annotations

import numpy as np
import pytest

from mdiedge.model.config import ModelConfig, RopeScaling
from mdiedge.model.rope import GrowingRope, rope_rows, rope_tables

LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
CONFIGS = {
    "llama": ModelConfig(vocab_size=32, dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                         intermediate_size=96),
    "llama3 scaled": ModelConfig(vocab_size=32, dim=256, n_layers=1, n_heads=2, n_kv_heads=1,
                                 intermediate_size=96, rope_theta=500000.0,
                                 rope_scaling=LLAMA3),
    "gemma3 global": ModelConfig(vocab_size=32, dim=64, n_layers=1, n_heads=1, n_kv_heads=1,
                                 intermediate_size=96, head_dim=256, rope_theta=1e6,
                                 rope_local_theta=1e4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("asks", [[1, 2, 300, 301, 1000], [5000], [700, 256, 4096, 4097]])
def test_growing_rows_equal_the_whole_table(name, local, asks):
    cfg, length = CONFIGS[name], 5000
    cos, sin = rope_tables(cfg, length, local)
    rope = GrowingRope(cfg, length, local)
    for ask in asks:
        rope.cover(ask)
        assert ask <= rope.filled <= max(ask, length)
        assert rope.filled % GrowingRope.ROWS_AT_ONCE == 0 or rope.filled == length
        done = rope.filled
        assert np.array_equal(rope.cos[:done].view(np.uint32), cos[:done].view(np.uint32))
        assert np.array_equal(rope.sin[:done].view(np.uint32), sin[:done].view(np.uint32))
        assert not rope.cos[done:].any() and not rope.sin[done:].any()


def test_rows_of_any_range_equal_the_table():
    cfg = CONFIGS["gemma3 global"]
    cos, sin = rope_tables(cfg, 3000, True)
    for start, stop in [(0, 1), (1, 2), (255, 1024), (2999, 3000), (17, 2048)]:
        c, s = rope_rows(cfg, start, stop, True)
        assert c.flags.c_contiguous and c.shape == (stop - start, cfg.head_dim)
        assert np.array_equal(c.view(np.uint32), cos[start:stop].view(np.uint32))
        assert np.array_equal(s.view(np.uint32), sin[start:stop].view(np.uint32))

