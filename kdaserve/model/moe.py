"""Sparse MoE feed-forward: sigmoid router with a selection-only bias, shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.model.layers import MLP, Expert


class Router(nn.Module):
    """Picks top-k experts. The correction bias only selects; weights are the unbiased scores."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.num_experts
        self.weight = nn.Parameter(torch.zeros(e, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_token
        self.groups = cfg.num_expert_group if cfg.use_grouped_topk else 1
        self.topk_group = cfg.topk_group if cfg.use_grouped_topk else 1
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.activation = cfg.moe_router_activation_func

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.activation == "sigmoid" else logits.softmax(-1)
        choice = scores + self.e_score_correction_bias
        if self.groups > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.groups, e // self.groups)
            group_score = grouped.topk(min(2, e // self.groups), -1).values.sum(-1)
            keep = group_score.topk(self.topk_group, -1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(e // self.groups, 1), float("-inf"))
        ids = choice.topk(self.top_k, -1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
            if cfg.num_shared_experts else None
        )
        self.load_counts: torch.Tensor | None = None  # set by trainers that balance the router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)                                   # [T,k]
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        if self.load_counts is not None:
            self.load_counts += counts.to(self.load_counts)
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):  # over experts, never tokens
            if n:
                rows = token_of[start:start + n]
                y = self.experts[e](x[rows]) * w_sorted[start:start + n, None].to(x.dtype)
                out.index_add_(0, rows, y)
                start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
