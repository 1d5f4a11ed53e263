"""The MoE router (kdaserve/model/moe.py): sigmoid (or softmax) scores over the experts, a
correction bias that only selects (the weights stay the unbiased scores), DeepSeek-style
grouped top-k where the config asks for it, renormalisation and the routed scaling factor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.model_config import ModelConfig


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
