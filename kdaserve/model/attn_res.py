"""Block attention-residuals (Kimi K3, `attn_res_block_size` bs): the residual stream is
replaced by a softmax-weighted mix of banked block sums.

State per token: a bank of finished block sums b_0 (the embedding), b_1, ... and the running
in-block sum P. Before a sublayer its input is
    h = Σ_s softmax_s(ℓ_s) · s,   s over bank ∪ {P},   ℓ_s = ⟨RMSNorm(s) · w_norm, w_proj⟩
(raw sources are mixed; the sublayer's own input norm comes after). At a block-start layer
(idx % bs == 0) P is banked after the attention mix and restarts from the attention output;
elsewhere P += the sublayer's output. After the last layer every source is mixed once more with
`output_attn_res_{norm,proj}`, then `model.norm` applies. With an empty bank (the first
layer) the mix is P itself. Legend: T tokens, H hidden, S sources.
"""

from __future__ import annotations

import torch


class ResidualBank:
    """The banked block sums of one forward, with each source's inverse RMS cached (fp32)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps
        self.raw: list[torch.Tensor] = []          # each [T, H]
        self.inv_rms: list[torch.Tensor] = []      # each [T] fp32

    def inv_rms_of(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return torch.rsqrt(xf.pow(2).mean(-1) + self.eps)

    def append(self, x: torch.Tensor) -> None:
        self.raw.append(x)
        self.inv_rms.append(self.inv_rms_of(x))


def attn_res_mix(bank: ResidualBank, partial: torch.Tensor, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor) -> torch.Tensor:
    """The mix before a sublayer (see the module doc). The checkpoint's `{point}_norm.weight`
    [H] and `{point}_proj.weight` [1, H] fold into one vector w = w_norm · w_proj, so a
    source's logit is (s · w) / rms(s). partial [T, H] -> [T, H]."""
    if not bank.raw:
        return partial
    w = norm_weight.float() * proj_weight.float().view(-1)                       # [H]
    logits = torch.stack([(s.float() @ w) * r for s, r in zip(bank.raw, bank.inv_rms)]
                         + [(partial.float() @ w) * bank.inv_rms_of(partial)])  # [S, T]
    p = torch.softmax(logits, 0)
    out = p[0, :, None] * bank.raw[0].float()
    for i in range(1, len(bank.raw)):
        out = out + p[i, :, None] * bank.raw[i].float()
    return (out + p[-1, :, None] * partial.float()).to(partial.dtype)
