"""Small building blocks shared by the mixers and feed-forwards."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.ops.activation import SILU, GLUActivation


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim); built under torch.device("meta") (the loader's shapes-only
    build) its weight is left uninitialised: the meta normal_ that nn.Embedding's init runs
    imports torch._dynamo (~1.5 s of CPU in every engine process) for values nobody reads.
    Elsewhere the usual init, so seeded random models stay as they were."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * sigmoid(gate), computed in fp32 (KDA output norm, per head)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x), up(x))), act SiLU-GLU (SwiGLU) or SiTU."""

    def __init__(self, hidden: int, intermediate: int, act: GLUActivation = SILU) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
