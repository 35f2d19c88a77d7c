"""A test double of a numpy model chunk (the CONTRACT of ``CpuModel``: ``takes_numpy``, numpy
in and out), doing something simple and checkable, so the runtime's numpy path is tested
without any real model and without torch.

Hidden states are one-hot rows over the vocabulary (dim == vocab). Block b maps the token t at
position p of a KV slot to (t + u + b + 1) mod vocab, where u is the token its input held at
position p - 1 of the same slot (0 at position 0): it reads its KV cache, so a wrong slot,
position or rewind shows in the tokens. ``reference`` computes the same over a whole text with
no cache. The head's logits are ``SCALE`` times the one-hot row: greedy takes the token,
sampling draws it with probability about a third (vocab 16).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from mdiedge.model.config import ModelConfig

VOCAB, LAYERS, SCALE = 16, 4, 2.0
CFG = ModelConfig(vocab_size=VOCAB, dim=VOCAB, n_layers=LAYERS, n_heads=1, n_kv_heads=1,
                  intermediate_size=VOCAB, max_seq_len=64)


class ShiftChunk:
    """Blocks [first, last) of the toy model; the embedding and head where asked."""

    takes_numpy = True

    def __init__(self, first: int = 0, last: int = LAYERS, embedding: bool = True,
                 head: bool = True) -> None:
        self.cfg, self.first, self.last = CFG, first, last
        self._embedding, self._head = embedding, head
        self.decode_route = {"blocks": "step", "head": "step"} if head else {"blocks": "step"}
        self.cache = np.zeros((0, 0, 0), dtype=np.int64)  # (block, slot, position) -> token
        self.calls: List[Dict[str, object]] = []  # what run_blocks was given (types checked)

    @property
    def has_embedding(self) -> bool:
        return self._embedding

    @property
    def has_head(self) -> bool:
        return self._head

    def setup_cache(self, n_slots: int, max_seq_len: Optional[int] = None) -> None:
        self.cache = np.zeros((self.last - self.first, n_slots, max_seq_len or CFG.max_seq_len),
                              dtype=np.int64)

    def kv_cache_bytes(self) -> int:
        return int(self.cache.nbytes)

    def parameter_bytes(self) -> int:
        return 0

    def expert_load(self) -> Dict[str, List[int]]:
        return {}

    def embed_tokens(self, tokens: np.ndarray) -> np.ndarray:
        assert tokens.dtype == np.int64 and tokens.ndim == 2, tokens.dtype
        return np.eye(VOCAB, dtype=np.float32)[tokens]

    def run_blocks(self, x: np.ndarray, slots: np.ndarray, positions: Sequence[int],
                   step: object = None) -> np.ndarray:
        assert step is None
        assert isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 3 and \
            x.flags.c_contiguous, (type(x), getattr(x, "dtype", None))
        assert isinstance(slots, np.ndarray) and slots.dtype == np.int64, type(slots)
        self.calls.append({"rows": x.shape[0], "width": x.shape[1], "start": min(positions)})
        tokens = x.argmax(-1)  # (B, T)
        for block in range(self.last - self.first):
            cache = self.cache[block]
            for b, (slot, start) in enumerate(zip(slots.tolist(), positions)):
                cache[slot, start:start + tokens.shape[1]] = tokens[b]
                before = [cache[slot, p - 1] if p > 0 else 0
                          for p in range(start, start + tokens.shape[1])]
                tokens[b] = (tokens[b] + np.array(before) + self.first + block + 1) % VOCAB
        return np.ascontiguousarray(np.eye(VOCAB, dtype=np.float32)[tokens])

    def head_logits(self, x: np.ndarray) -> np.ndarray:
        assert x.dtype == np.float32 and x.ndim in (2, 3)
        return (x * np.float32(SCALE)).astype(np.float32)


def reference(tokens: Sequence[int], layers: int = LAYERS) -> int:
    """The toy model's greedy next token after ``tokens``, from scratch."""
    row = list(tokens)
    for block in range(layers):
        row = [(t + (row[p - 1] if p > 0 else 0) + block + 1) % VOCAB for p, t in enumerate(row)]
    return row[-1]


def greedy_reference(prompt: Sequence[int], n: int) -> List[int]:
    text = list(prompt)
    for _ in range(n):
        text.append(reference(text))
    return text[len(prompt):]
