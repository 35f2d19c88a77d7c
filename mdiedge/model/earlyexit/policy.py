"""Early exit: when a decode step may stop after a block, and what the skipped blocks keep.

Three confidence measures of a block's output ``h`` (Schuster et al. 2022, "Confident
Adaptive Language Modeling"; the iteration-level batch rule after Chen et al. 2023,
"EE-LLM"/the vLLM early-exit framework):

- ``softmax``: top-1 minus top-2 probability of the shared final norm and head on ``h``;
- ``similarity``: cosine between ``h`` and the previous block's output (the block's input);
- ``classifier``: a small per-block model's probability that the head on ``h`` already
  predicts what the last block would (``ExitClassifier``, trained on the model's own states).

A row is eligible once its confidence after block ``i`` reaches ``thresholds[i]``, and stays
eligible for the rest of the step (sticky); a micro-batch exits when every row is eligible.
The blocks it skips still get keys and values: ``Transformer.fill_kv`` puts the exit state
through their K/V projections, so later tokens attend over a complete cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...base.defaults import EARLY_EXIT_CRITERIA
from ...base.errors import ConfigError

CRITERIA = EARLY_EXIT_CRITERIA
NEVER = math.inf  # the threshold of a block after which no row exits
CLASSIFIER_HIDDEN = 32


def softmax_margin(logits: Tensor) -> Tensor:
    """(B, vocab) -> (B,) top-1 minus top-2 probability."""
    top = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1).values  # (B, 2)
    return top[:, 0] - top[:, 1]


def cosine(h: Tensor, previous: Tensor) -> Tensor:
    return F.cosine_similarity(h.float(), previous.float(), dim=-1)


class ExitClassifier(nn.Module):
    """One small MLP per block: (B, dim) output -> (B,) probability the head gives the last block's
    top-1 there. Inputs RMS-normalized (no learned scale), so it serves every hidden-state scale."""

    def __init__(self, n_layers: int, dim: int, hidden: int = CLASSIFIER_HIDDEN) -> None:
        super().__init__()
        self.n_layers, self.dim, self.hidden = n_layers, dim, hidden
        self.w1 = nn.Parameter(torch.zeros(n_layers, dim, hidden))
        self.b1 = nn.Parameter(torch.zeros(n_layers, hidden))
        self.w2 = nn.Parameter(torch.zeros(n_layers, hidden))
        self.b2 = nn.Parameter(torch.zeros(n_layers))

    def logit(self, layer: int, h: Tensor) -> Tensor:
        x = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        z = torch.relu(x @ self.w1[layer] + self.b1[layer])  # (…, hidden)
        return z @ self.w2[layer] + self.b2[layer]

    def forward(self, layer: int, h: Tensor) -> Tensor:
        return torch.sigmoid(self.logit(layer, h))


Head = Callable[[Tensor], Tensor]  # (B, dim) hidden -> (B, vocab) logits: final norm + head


@dataclass
class ExitPolicy:
    """A criterion and a threshold per block (``NEVER``: no exit; the last block's is ignored).
    ``head`` for ``softmax``, ``classifier`` for ``classifier``."""

    criterion: str
    thresholds: List[float]
    head: Optional[Head] = None
    classifier: Optional[ExitClassifier] = None

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ConfigError(f"unknown early-exit criterion {self.criterion!r}; "
                              f"choose one of {', '.join(CRITERIA)}")
        if self.criterion == "classifier" and self.classifier is None:
            raise ConfigError("the classifier criterion needs an exit classifier")

    def checks(self, layer: int) -> bool:
        return layer < len(self.thresholds) - 1 and self.thresholds[layer] < NEVER

    def confidence(self, layer: int, h: Tensor, previous: Tensor) -> Tensor:
        """(B, dim) output and input -> (B,)."""
        if self.criterion == "softmax":
            if self.head is None:
                raise ConfigError("the softmax criterion needs the model's final norm and head")
            return softmax_margin(self.head(h))
        if self.criterion == "similarity":
            return cosine(h, previous)
        assert self.classifier is not None
        return self.classifier(layer, h)


@dataclass
class ExitStep:
    """Which rows are eligible (sticky) and, once all are, after how many blocks the step exited."""

    policy: ExitPolicy
    eligible: List[bool]  # per row
    depth: int = 0  # blocks run before the exit; 0 while it has not exited
    checked: List[int] = field(default_factory=list)  # blocks whose criterion ran
    fill_s: float = 0.0  # seconds of KV fill after the exit, on this node

    @classmethod
    def start(cls, policy: ExitPolicy, rows: int, eligible: Sequence[bool] = (),
              depth: int = 0) -> "ExitStep":
        return cls(policy, [bool(e) for e in eligible] if eligible else [False] * rows, depth)

    @property
    def exited(self) -> bool:
        return self.depth > 0

    def after_block(self, layer: int, h: Tensor, previous: Tensor) -> bool:
        """True when the whole step exits here."""
        if self.exited or not self.policy.checks(layer):
            return False
        if not all(self.eligible):
            self.checked.append(layer)
            threshold = self.policy.thresholds[layer]
            scores = self.policy.confidence(layer, h[:, -1], previous[:, -1]).tolist()  # (B,)
            self.eligible = [e or s >= threshold for e, s in zip(self.eligible, scores)]
        if all(self.eligible):
            self.depth = layer + 1
            return True
        return False

    def eligible_list(self) -> List[bool]:
        """For the next node (empty when none is)."""
        return list(self.eligible) if any(self.eligible) else []
