"""Sparse MoE feed-forward: sigmoid router with a selection-only bias, shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.config import ModelConfig
from kdaserve.model.layers import MLP
from kdaserve.ops.cpu_kernels import moe_experts_kernel


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
    """Routed experts stored stacked (`experts_w13` = w1 | w3 per expert, `experts_w2`); the
    loader maps the checkpoint's per-expert names onto them.

    Slots (token, expert) are grouped by expert, then every active expert's group runs through
    its fused w13 and w2: on CPU through the compiled ragged-group kernel; elsewhere one matmul
    per expert when groups are large or few (prefill, single-token decode), or one padded
    batched matmul when groups are small (over all experts when most are active, so no weights
    are copied), where padding and gathers cost less than many small calls.
    Legend: T tokens, k experts per token, E experts, I width, H hidden.
    """

    # groups at least this large on average, or at most this many experts: per-expert matmuls
    LARGE_GROUP = 32
    FEW_EXPERTS = 4

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.intermediate = e, i
        self.gate = Router(cfg)
        self.experts_w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
            if cfg.num_shared_experts else None
        )
        self.load_counts: torch.Tensor | None = None  # set by trainers that balance the router

    def transpose_expert_storage(self) -> None:
        """Inference on CPU: keep each expert's weights transposed in memory (w13 as [H, 2I],
        w2 as [I, H]), the layout the compiled ragged-group kernel reads. The parameters stay
        [E, 2I, H] / [E, H, I] views with the checkpoint's names; matmuls read either layout
        at the same speed, and nothing is stored twice."""
        for name in ("experts_w13", "experts_w2"):
            p = getattr(self, name)
            t = p.detach().transpose(1, 2).contiguous()
            setattr(self, name, nn.Parameter(t.transpose(1, 2), requires_grad=False))

    def _ragged_kernel(self, x: torch.Tensor):
        """The compiled kernel when it applies: CPU, fp32, no autograd, transposed storage."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled() and (
                x.requires_grad or self.experts_w13.requires_grad
                or self.experts_w2.requires_grad):
            return None
        w13t, w2t = self.experts_w13.transpose(1, 2), self.experts_w2.transpose(1, 2)
        if not (w13t.is_contiguous() and w2t.is_contiguous()
                and w13t.dtype == w2t.dtype == torch.float32):
            return None
        return moe_experts_kernel()

    def _expert_mlp(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """One expert ([n,H], weights 2-D) or a padded group of experts ([Ea,cap,H], 3-D)."""
        batched = w13.dim() == 3
        h = torch.bmm(x, w13.transpose(1, 2)) if batched else F.linear(x, w13)
        h = F.silu(h[..., : self.intermediate]) * h[..., self.intermediate:]
        return torch.bmm(h, w2.transpose(1, 2)) if batched else F.linear(h, w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)                                    # [T,k]
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)                              # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)      # [E]
        if self.load_counts is not None:
            self.load_counts += counts.to(self.load_counts)
        token = order // k
        slot_w = weights.reshape(-1)[order, None].to(x.dtype)
        count_list = counts.tolist()
        active = [e for e, n in enumerate(count_list) if n]
        out = torch.zeros_like(x)
        kernel = self._ragged_kernel(x)
        if kernel is not None:
            # each expert's group at its own size (no padding to the busiest expert); faster
            # than per-expert matmuls at every batch size measured (docs/benchmarks.md)
            offsets = torch.zeros(self.num_experts + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=offsets[1:])
            kernel(x, token, offsets, slot_w.view(-1), self.experts_w13.transpose(1, 2),
                   self.experts_w2.transpose(1, 2), out)
        elif len(active) <= self.FEW_EXPERTS or flat.numel() >= self.LARGE_GROUP * len(active):
            start = 0
            for e in active:
                n = count_list[e]
                rows = token[start:start + n]
                y = self._expert_mlp(x[rows], self.experts_w13[e], self.experts_w2[e])
                out.index_add_(0, rows, y * slot_w[start:start + n])
                start += n
        else:
            expert_sorted = flat[order]
            rank = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[
                expert_sorted]
            w13, w2 = self.experts_w13, self.experts_w2
            if len(active) * 2 >= self.num_experts:
                # most experts are active: run all of them, empty groups included, rather
                # than copy the active experts' weights out (a copy costs more than the rows)
                rows, groups = expert_sorted, self.num_experts
            else:
                act = torch.tensor(active, device=x.device)
                group = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
                group[act] = torch.arange(len(active), device=x.device)
                rows, groups = group[expert_sorted], len(active)
                w13, w2 = w13[act], w2[act]
            buf = x.new_zeros(groups, max(count_list), x.shape[1])
            buf[rows, rank] = x[token]                                 # [G,cap,H]
            y = self._expert_mlp(buf, w13, w2)[rows, rank]             # [T*k,H]
            out.index_add_(0, token, y * slot_w)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
