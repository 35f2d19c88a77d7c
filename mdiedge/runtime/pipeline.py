"""A pipeline: the ordered stages a message goes through, and the embedding and head around them.

In-process ``LocalStage``s run as a message is submitted; a remote tail (the ring's links, see
``mdiedge.roles.starter``) carries it on through the workers and back. Either way results come back
in submission order, as on a ring, so the scheduler cannot tell the two apart: ``--nodes 1`` is one
local stage, a ring is the starter's local stage plus the remote tail, and N local stages test the
scheduler's grouping, chunking and release without sockets."""
from __future__ import annotations

import collections
from typing import Any, Deque, List, Optional, Sequence, Tuple

import numpy as np

from .messages import Message
from .stages import LocalStage, as_tensor, inference, takes_numpy
from ..base.arrays import float32
from ..base.errors import RingError


class RemoteStages:
    """Reached over links; the ring implements it."""

    nodes = 0  # how many nodes the tail spans

    def send(self, message: Message) -> None:
        raise NotImplementedError

    def receive(self, timeout: Optional[float]) -> Message:
        """The next message back; RingError when the ring broke or timed out."""
        raise NotImplementedError


class EmbedAndHead:
    """The starter's, wherever the blocks run; ``head`` includes the final norm and gives
    float32 numpy logits whichever kind of chunk made them."""

    def __init__(self, model: Any) -> None:  # a chunk with embedding and head
        if not (model.has_embedding and model.has_head):
            raise ValueError("the model ends need a chunk with the embedding and the head")
        self.model = model
        self.numpy = takes_numpy(model)
        if not self.numpy:
            param = next(model.parameters())
            self.device = param.device

    def embed(self, tokens: List[List[int]]) -> Any:
        """(B, T) token ids -> (B, T, dim) hidden states (float32 numpy, or a tensor of a
        torch chunk)."""
        if self.numpy:
            return self.model.embed_tokens(np.array(tokens, dtype=np.int64))
        import torch

        with inference():
            return self.model.embed_tokens(torch.tensor(tokens, device=self.device))

    def head(self, hidden: Any) -> np.ndarray:
        """(B, dim) hidden states (one per row) -> (B, vocab) float32 numpy logits."""
        if self.numpy:
            rows = float32(hidden)
            return self.model.head_logits(rows.reshape(rows.shape[0], -1))  # decode: the step
        with inference():
            logits = self.model.head_logits(as_tensor(hidden, self.device))
            return logits.detach().float().cpu().numpy()


class Pipeline:
    """``stages`` in this process, in ring order, then the optional remote ``tail``."""

    def __init__(self, stages: Sequence[LocalStage], tail: Optional[RemoteStages] = None) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one local stage")
        self.stages = list(stages)
        self.tail = tail
        self._done: Deque[Message] = collections.deque()

    @property
    def nodes(self) -> int:
        return len(self.stages) + (self.tail.nodes if self.tail is not None else 0)

    @property
    def n_slots(self) -> int:
        return min(stage.n_slots for stage in self.stages)

    @property
    def context(self) -> int:
        return min(stage.context for stage in self.stages)

    @property
    def layout(self) -> Tuple[int, int]:
        """Its KV slots and tokens per slot (``plan.layout_for``)."""
        return self.n_slots, self.context

    def submit(self, message: Message) -> None:
        for stage in self.stages:
            message = stage.forward(message)
        if self.tail is not None:
            self.tail.send(message)
        else:
            self._done.append(message)

    def receive(self, timeout: Optional[float] = None) -> Message:
        if self.tail is not None:
            return self.tail.receive(timeout)
        if not self._done:
            raise RingError("nothing in flight to receive")
        return self._done.popleft()
