"""Sparse mixture-of-experts feed-forward, as in Mixtral (Jiang et al. 2024).

Router logits go through an fp32 softmax; the top ``k`` experts are kept, renormalised as
transformers' Mixtral does (Qwen3-MoE only where ``norm_topk_prob`` says). Assignments are grouped
by expert (Switch Transformers, MegaBlocks, without capacity limit or padding): each expert with
tokens runs ONE batched SwiGLU call on exactly its tokens, outputs scattered back with
``index_add_``; idle experts cost nothing. The grouping (a stable sort) runs in numpy on the CPU
(``grouping``); on CUDA or with gradients as torch ops on the device, only the ``E + 1`` offsets
coming to the host."""
from __future__ import annotations

from types import ModuleType
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from . import grouping
from .config import ModelConfig
from .layers import MLP

Routing = Union[ModuleType, str]  # a module with ``group_by_expert``, or "torch"


class MoE(nn.Module):
    """Parameters ``router.weight`` and ``experts.{e}.gate/up/down``. ``routing``: a module with
    ``group_by_expert`` for CPU tensors (default ``grouping``) or ``"torch"`` (CUDA always).
    ``expert_counts``: tokens per expert since :meth:`reset_stats`."""

    def __init__(self, cfg: ModelConfig, routing: Optional[Routing] = None) -> None:
        super().__init__()
        if not cfg.is_moe:
            raise ValueError("MoE needs a config with n_experts > 0")
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.renormalize = cfg.norm_topk_prob
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.dim, cfg.intermediate_size)
                                     for _ in range(cfg.n_experts))
        self.routing: Routing = grouping if routing is None else routing
        self.expert_counts = torch.zeros(cfg.n_experts, dtype=torch.int64)  # not a buffer

    def reset_stats(self) -> None:
        self.expert_counts.zero_()

    def route(self, x_flat: Tensor) -> Tuple[Tensor, Tensor]:
        """Expert ids (N, k) int64 and weights (N, k) fp32, summing to one where the config
        renormalises."""
        logits = self.router(x_flat)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E) fp32
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def group(self, experts: Tensor, weights: Tensor) -> Tuple[List[int], Tensor, Tensor]:
        """``(offsets, token_idx, weights)``: expert ``e``'s rows are
        ``token_idx[offsets[e]:offsets[e + 1]]``, ascending."""
        on_device = (experts.device.type != "cpu" or self.routing == "torch"
                     or (weights.requires_grad and torch.is_grad_enabled()))
        if on_device:
            flat = experts.reshape(-1)  # (N*k,) assignment a = token * k + j
            order = torch.sort(flat, stable=True)[1]  # (N*k,) grouped by expert, stable
            counts = torch.bincount(flat, minlength=self.n_experts)  # (E,) ids come from topk
            offsets = [0] + torch.cumsum(counts, 0).tolist()  # the one device -> host copy
            return offsets, order // self.top_k, weights.reshape(-1)[order]
        assert not isinstance(self.routing, str)
        off, token_idx, grouped_w = self.routing.group_by_expert(
            experts.numpy(), weights.detach().numpy(), self.n_experts)
        return off.tolist(), torch.from_numpy(token_idx), torch.from_numpy(grouped_w)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, dim = x.shape
        x_flat = x.reshape(batch * seq_len, dim)  # (N, dim)
        experts, weights = self.route(x_flat)  # (N, k), (N, k)
        if batch * seq_len == 1 and x.device.type == "cpu":  # on CUDA: no host round trips
            return self._one_token(x_flat, experts[0], weights[0]).view(batch, seq_len, dim)
        offsets, token_idx, grouped_w = self.group(experts, weights)  # (E+1,), (N*k,), (N*k,)
        grouped_w = grouped_w.to(x.dtype)
        counts = [offsets[e + 1] - offsets[e] for e in range(self.n_experts)]
        self.expert_counts += torch.tensor(counts, dtype=torch.int64)
        out = torch.zeros_like(x_flat)  # (N, dim)
        for e, expert in enumerate(self.experts):
            start, end = offsets[e], offsets[e + 1]
            if start == end:
                continue
            rows = token_idx[start:end]  # (n_e,) token rows of expert e
            y = expert(x_flat.index_select(0, rows))  # (n_e, dim): one batched call
            out.index_add_(0, rows, y * grouped_w[start:end, None])
        return out.view(batch, seq_len, dim)

    def _one_token(self, x_flat: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """A single sample's CPU decode: its k experts in ascending order (the grouped path's
        order), no grouping built."""
        order = torch.argsort(experts)
        out = torch.zeros_like(x_flat)  # (1, dim)
        weights = weights.to(x_flat.dtype)
        for j in order.tolist():
            out += self.experts[int(experts[j])](x_flat) * weights[j]
        self.expert_counts[experts] += 1
        return out
