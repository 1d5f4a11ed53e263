"""Gated activations of the feed-forwards: act(gate, up) in one place, so the dense MLP, the
shared experts, the torch expert path and the compiled MoE kernel agree.

- SiLU (Kimi Linear): act = silu(gate) * up.
- SiTU (Kimi K3, `hidden_act: situ`): act = b·tanh(gate/b)·sigmoid(gate) × clip(up), with
  b = `activation_situ_beta` and clip(up) = lb·tanh(up/lb) when `activation_situ_linear_beta`
  lb is set, else up. Computed in fp32 (as mlx-lm does), cast back to up's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GLUActivation:
    kind: str = "silu"                   # "silu" | "situ"
    beta: float = 1.0                    # SiTU gate clip b
    linear_beta: float | None = None     # SiTU up clip lb, None: no clip

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "situ"):
            raise ValueError(f"activation must be 'silu' or 'situ', got {self.kind!r}")
        if self.kind == "situ" and (self.beta <= 0 or (self.linear_beta is not None
                                                       and self.linear_beta <= 0)):
            raise ValueError("SiTU betas must be positive")

    @property
    def code(self) -> int:
        """The compiled kernels' activation selector: 0 SiLU, 1 SiTU."""
        return 0 if self.kind == "silu" else 1

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        g, u = gate.float(), up.float()
        a = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        if self.linear_beta is not None:
            u = self.linear_beta * torch.tanh(u / self.linear_beta)
        return (a * u).to(up.dtype)


SILU = GLUActivation()
