"""Sparse MoE feed-forward: sigmoid router with a selection-only bias, shared experts; the
Kimi K3 variants: latent experts, SiTU, MXFP4-packed expert weights."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.model.layers import MLP, RMSNorm
from kdaserve.model.router import Router
from kdaserve.model_config import ModelConfig
from kdaserve.ops import cpu_int_linear, gpu, moe_kernel
from kdaserve.ops.cpu_linear import k_major, linear
from kdaserve.ops.int_quant import dequantize
from kdaserve.ops.mxfp4 import GROUP, dequantize_mxfp4


class SparseMoE(nn.Module):
    """Routed experts stored stacked (`experts_w13` = w1 | w3 per expert, `experts_w2`); the
    loader maps the checkpoint's per-expert names onto them. With MXFP4 experts (K3) the stacks
    hold the checkpoint's packed bytes instead (`experts_w13_packed` uint8 [E, 2I, W/2] and
    `experts_w13_scale` [E, 2I, W/32], likewise w2): they are never expanded as a whole; the
    compiled CPU kernel reads them directly, the torch path dequantizes one expert at a time
    into a reused buffer. INT8/INT4 experts (`int_quant`, kdaserve/model/quantize.py) are
    stored the same way with fp32 group scales (kdaserve/ops/int_quant.py).

    Latent MoE (K3, `routed_expert_hidden_size` W): the router and the shared experts read the
    full hidden x; the routed experts run on z = routed_expert_down_proj(x) [T, W], their
    weighted sum goes through `routed_expert_norm` (when `latent_moe_use_norm`) and
    `routed_expert_up_proj` back to the hidden width:
        out = up(norm(sum_k w_k · expert_k(z))) + shared(x).

    Slots (token, expert) are grouped by expert, then every active expert's group runs through
    its fused w13 and w2: on CUDA with triton through the grouped Triton kernels (sync-free,
    MXFP4 decoded inside; kdaserve/ops/gpu/moe_grouped.py); on CPU through the compiled
    ragged-group kernel; elsewhere one matmul
    per expert when groups are large or few (prefill, single-token decode), or one padded
    batched matmul when groups are small (over all experts when most are active, so no weights
    are copied), where padding and gathers cost less than many small calls.
    Legend: T tokens, k experts per token, E experts, I width, H hidden, W expert input width.
    """

    # groups at least this large on average, or at most this many experts: per-expert matmuls
    LARGE_GROUP = 32
    FEW_EXPERTS = 4
    # a WeightQuant when the experts are stored INT8/INT4 (set by kdaserve/model/quantize.py)
    int_quant = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, w = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_width
        self.num_experts, self.intermediate, self.width = e, i, w
        self.act = cfg.activation
        self.gate = Router(cfg)
        self.quantized = cfg.experts_quantization == "mxfp4"
        if self.quantized:
            for name, shape in (("experts_w13", (e, 2 * i, w)), ("experts_w2", (e, w, i))):
                packed = torch.zeros(*shape[:2], shape[2] // 2, dtype=torch.uint8)
                scale = torch.zeros(*shape[:2], shape[2] // GROUP, dtype=torch.uint8)
                self.register_buffer(f"{name}_packed", packed)
                self.register_buffer(f"{name}_scale", scale)
            self._dequant: tuple[torch.Tensor, torch.Tensor] | None = None
        else:
            self.experts_w13 = nn.Parameter(torch.empty(e, 2 * i, w))
            self.experts_w2 = nn.Parameter(torch.empty(e, w, i))
        if cfg.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, w, bias=False)
            self.routed_expert_up_proj = nn.Linear(w, cfg.hidden_size, bias=False)
            self.routed_expert_norm = (RMSNorm(w, cfg.rms_norm_eps) if cfg.latent_moe_use_norm
                                       else None)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, self.act)
            if cfg.num_shared_experts else None
        )
        self.load_counts: torch.Tensor | None = None  # set by trainers that balance the router

    @property
    def is_latent(self) -> bool:
        return hasattr(self, "routed_expert_down_proj")

    def weight_bytes(self) -> tuple[int, int]:
        """(bytes, logical weights) of the routed experts as stored."""
        names = (("experts_w13_packed", "experts_w13_scale", "experts_w2_packed",
                  "experts_w2_scale", "experts_w13_zero_point", "experts_w2_zero_point")
                 if self.quantized else ("experts_w13", "experts_w2"))
        ts = [t for t in (getattr(self, n, None) for n in names) if t is not None]
        count = self.num_experts * 3 * self.intermediate * self.width
        return sum(t.numel() * t.element_size() for t in ts), count

    def transpose_expert_storage(self) -> None:
        """Inference on CPU: keep each expert's weights transposed in memory (w13 as [H, 2I],
        w2 as [I, H]), the layout the compiled ragged-group kernel (fp32) and the fused decode
        blocks (fp32, bf16) read fastest. The parameters stay
        [E, 2I, H] / [E, H, I] views with the checkpoint's names; matmuls read either layout
        at the same speed, and nothing is stored twice."""
        if self.quantized:
            return
        for name in ("experts_w13", "experts_w2"):
            p = getattr(self, name)
            t = p.detach().transpose(1, 2).contiguous()
            setattr(self, name, nn.Parameter(t.transpose(1, 2), requires_grad=False))

    def _ragged_kernel(self, x: torch.Tensor):
        """The compiled kernel when it applies: CPU, fp32, no autograd, transposed storage."""
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        if self.quantized:
            if self.int_quant is not None:
                return cpu_int_linear.experts_kernel()
            return moe_kernel.moe_experts_mxfp4_kernel()
        if torch.is_grad_enabled() and (x.requires_grad or self.experts_w13.requires_grad
                                        or self.experts_w2.requires_grad):
            return None
        w13t, w2t = self.experts_w13.transpose(1, 2), self.experts_w2.transpose(1, 2)
        if not (w13t.is_contiguous() and w2t.is_contiguous()
                and w13t.dtype == w2t.dtype == torch.float32):
            return None
        return moe_kernel.moe_experts_kernel()

    def _compiled_bf16(self, x: torch.Tensor) -> bool:
        """bf16 experts stored transposed on CPU: one expert at a time through the compiled
        product (fp32 sums over bf16 weights); torch's bf16 batched products crawl on CPUs
        without bf16 arithmetic."""
        return (x.device.type == "cpu" and not self.quantized
                and self.experts_w13.dtype == torch.bfloat16 and k_major(self.experts_w13[0])
                and k_major(self.experts_w2[0]))

    def _triton_grouped(self, x: torch.Tensor):
        """The grouped Triton kernels when they apply: a device they run on, triton importable
        (KDASERVE_TRITON=0: not), no autograd (they have no backward)."""
        if not gpu.kernels_for(x.device.type) or self.int_quant is not None:
            return None        # (INT8/INT4 stacks: the per-expert dequantized form on GPU)
        if torch.is_grad_enabled() and (x.requires_grad or any(
                p.requires_grad for p in (getattr(self, "experts_w13", None),
                                          getattr(self, "experts_w2", None)) if p is not None)):
            return None
        from kdaserve.ops.gpu.moe_grouped import ExpertWeights, fused_moe

        if self.quantized:
            w13 = ExpertWeights(self.experts_w13_packed, self.experts_w13_scale)
            w2 = ExpertWeights(self.experts_w2_packed, self.experts_w2_scale)
        else:
            w13, w2 = ExpertWeights(self.experts_w13), ExpertWeights(self.experts_w2)
        return lambda x, weights, ids: fused_moe(x, weights, ids, w13, w2, self.act)

    def _expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, W], w2 [W, I]); MXFP4 experts are dequantized into buffers
        reused from expert to expert (never the whole stack at once)."""
        if not self.quantized:
            return self.experts_w13[e], self.experts_w2[e]
        i, w = self.intermediate, self.width
        dev = self.experts_w13_packed.device
        if self._dequant is None or self._dequant[0].dtype != dtype \
                or self._dequant[0].device != dev:
            self._dequant = (torch.empty(2 * i, w, dtype=dtype, device=dev),
                             torch.empty(w, i, dtype=dtype, device=dev))
        b13, b2 = self._dequant
        if self.int_quant is not None:
            for buf, stack, k in ((b13, "experts_w13", w), (b2, "experts_w2", i)):
                zero = getattr(self, f"{stack}_zero_point", None)
                buf.copy_(dequantize(getattr(self, f"{stack}_packed")[e],
                                     getattr(self, f"{stack}_scale")[e],
                                     None if zero is None else zero[e], self.int_quant.bits,
                                     k, self.int_quant.group_size))
            return b13, b2
        dequantize_mxfp4(self.experts_w13_packed[e], self.experts_w13_scale[e], out=b13)
        dequantize_mxfp4(self.experts_w2_packed[e], self.experts_w2_scale[e], out=b2)
        return b13, b2

    def _expert_mlp(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """One expert ([n,H], weights 2-D) or a padded group of experts ([Ea,cap,H], 3-D)."""
        batched = w13.dim() == 3
        # (2-D: the compiled product where the expert is stored transposed, cpu_linear.py)
        h = torch.bmm(x, w13.transpose(1, 2)) if batched else linear(x, w13)
        h = self.act(h[..., : self.intermediate], h[..., self.intermediate:])
        return torch.bmm(h, w2.transpose(1, 2)) if batched else linear(h, w2)

    def _routed_all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                            ) -> torch.Tensor:
        """The routed sum with shapes fixed by T alone, never reading counts back, for decode
        steps of few tokens on the device (a grouped GPU kernel is the fast form). Fewer
        slots than experts: each slot gathers its expert's weights (reads T*k experts, as
        many as the grouped forms at batch 1). Otherwise every expert runs over a [T, W] group
        in which each token sits at its own row (a token picks an expert once), zero where it
        did not pick it: each expert's weights read once, E/k times the arithmetic."""
        T, k = ids.shape
        E = self.num_experts
        flat = ids.reshape(-1)
        tok = torch.arange(T, device=x.device).repeat_interleave(k, output_size=T * k)
        if T * k < E:
            y = self._expert_mlp(x[tok][:, None], self.experts_w13[flat],
                                 self.experts_w2[flat])[:, 0]           # [T*k, W]
        else:
            rows = flat * T + tok                                        # into [E*T]
            buf = x.new_zeros(E * T, x.shape[1])
            buf[rows] = x[tok]
            y = self._expert_mlp(buf.view(E, T, -1), self.experts_w13,
                                 self.experts_w2).reshape(E * T, -1)[rows]
        out = torch.zeros_like(x)
        out.index_add_(0, tok, y * weights.reshape(-1, 1).to(x.dtype))
        return out

    # how the routed experts run (kdaserve/model/moe_backends.py); None: grouped (_routed)
    routed_backend = None

    def forward(self, x: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        """sync_free: route without reading the expert counts back to the host (a
        device-resident decode step; kdaserve/engine/decode_inputs.py)."""
        weights, ids = self.gate(x)                                    # [T,k]
        z = self.routed_expert_down_proj(x) if self.is_latent else x   # [T,W]
        out = (self._routed(z, weights, ids, sync_free) if self.routed_backend is None
               else self.routed_backend(self, z, weights, ids))
        if self.is_latent:
            if self.routed_expert_norm is not None:
                out = self.routed_expert_norm(out)
            out = self.routed_expert_up_proj(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                sync_free: bool = False) -> torch.Tensor:
        """sum_k weights[t,k] · expert_{ids[t,k]}(x[t]) for every token: [T,W]."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        grouped_gpu = self._triton_grouped(x)
        kernel = None if grouped_gpu is not None else self._ragged_kernel(x)
        if grouped_gpu is not None or (kernel is None and sync_free and not self.quantized):
            if self.load_counts is not None:     # (bincount on CUDA reads its max back)
                self.load_counts.index_add_(0, flat, torch.ones_like(flat).to(
                    self.load_counts))
            if grouped_gpu is not None:
                return grouped_gpu(x, weights, ids)
            return self._routed_all_experts(x, weights, ids)
        order = flat.argsort(stable=True)                              # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)      # [E]
        if self.load_counts is not None:
            self.load_counts += counts.to(self.load_counts)
        token = order // k
        slot_w = weights.reshape(-1)[order, None].to(x.dtype)
        out = torch.zeros_like(x)
        count_list = counts.tolist() if kernel is None else []
        active = [e for e, n in enumerate(count_list) if n]
        if kernel is not None:
            # each expert's group at its own size (no padding to the busiest expert); faster
            # than per-expert matmuls at every batch size measured (docs/benchmarks.md)
            offsets = torch.zeros(self.num_experts + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=offsets[1:])
            if self.int_quant is not None:
                kernel(x, token, offsets, slot_w.view(-1), self, out, act=self.act)
            elif self.quantized:
                kernel(x, token, offsets, slot_w.view(-1), self.experts_w13_packed,
                       self.experts_w13_scale, self.experts_w2_packed, self.experts_w2_scale,
                       out, act=self.act)
            else:
                kernel(x, token, offsets, slot_w.view(-1), self.experts_w13.transpose(1, 2),
                       self.experts_w2.transpose(1, 2), out, act=self.act)
        elif (self.quantized or len(active) <= self.FEW_EXPERTS
              or flat.numel() >= self.LARGE_GROUP * len(active) or self._compiled_bf16(x)):
            start = 0
            for e in active:
                n = count_list[e]
                rows = token[start:start + n]
                y = self._expert_mlp(x[rows], *self._expert(e, x.dtype))
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
        return out
