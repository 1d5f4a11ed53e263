"""The compiled routed-expert MLPs over ragged groups (csrc/moe_cpu.c) for SparseMoE's CPU
path: fp32 experts stored transposed, or MXFP4 ones read in place (kdaserve.ops.mxfp4). The
INT8/INT4 experts are cpu_int_linear's; the fused decode blocks' MoE reads its activation
arguments from here too (activation_args)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import torch

from kdaserve.ops.cpu_kernels import _F32, _I64, _PTR, _c_function, _ptr, parallel_rows

if TYPE_CHECKING:
    from kdaserve.ops.activation import GLUActivation

MoEExperts = Callable[..., torch.Tensor]


def activation_args(act: GLUActivation | None) -> tuple[int, float, float]:
    """(selector, beta, linear_beta) of the MoE kernels' activation: SiLU for None;
    linear_beta <= 0 means no up clip."""
    if act is None or act.code == 0:
        return 0, 1.0, 0.0
    return act.code, float(act.beta), float(act.linear_beta or 0.0)


@cache
def moe_experts_kernel() -> MoEExperts | None:
    """The compiled routed-expert MLPs over ragged groups (csrc/moe_cpu.c), or None."""
    fn = _c_function("moe_cpu.c", "moe_experts_rows",
                     [_I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                      _PTR, _I64, _F32, _F32])
    # the SiLU-only entry point of before the selector keeps its argument types for callers
    # that bind the library directly
    _c_function("moe_cpu.c", "moe_experts",
                [_I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR])
    if fn is None:
        return None

    def run(x: torch.Tensor, token: torch.Tensor, offsets: torch.Tensor, slot_w: torch.Tensor,
            w13t: torch.Tensor, w2t: torch.Tensor, out: torch.Tensor,
            act: GLUActivation | None = None) -> torch.Tensor:
        """x [T,H]; token [S] int64 slots grouped by expert (ascending within a group),
        offsets [E+1] int64 the groups' bounds; slot_w [S]; w13t [E,H,2I], w2t [E,I,H]
        contiguous; out [T,H] gets += slot_w * expert MLP(x[token]) with the gated
        activation `act` (None: SiLU). All fp32. Returns out.
        The tokens split over torch's threads (each thread reads every expert's weights);
        without OpenMP the call stays on the calling thread: a Python pool was slower."""
        E, H, I2 = w13t.shape
        x, token, offsets, slot_w = (t.contiguous() for t in (x, token, offsets, slot_w))
        assert w13t.is_contiguous() and w2t.is_contiguous() and out.is_contiguous()
        assert all(t.dtype == torch.float32 for t in (x, slot_w, w13t, w2t, out))
        assert token.dtype == offsets.dtype == torch.int64 and offsets.numel() == E + 1
        assert w2t.shape == (E, I2 // 2, H) and x.shape[1] == H == out.shape[1]
        parallel_rows("moe_cpu.c", fn, x.shape[0], token.numel() * I2, E, H, I2 // 2, _ptr(x),
                      _ptr(token), _ptr(offsets), _ptr(slot_w), _ptr(w13t), _ptr(w2t),
                      _ptr(out), *activation_args(act), pool=False)
        return out

    return run


@cache
def moe_experts_mxfp4_kernel() -> MoEExperts | None:
    """The compiled routed-expert MLPs on MXFP4 weights read in place (csrc/moe_cpu.c,
    `moe_experts_mxfp4`), or None (no compiler, disabled, build failed)."""
    fn = _c_function("moe_cpu.c", "moe_experts_mxfp4_rows",
                     [_I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR,
                      _PTR, _PTR, _PTR, _I64, _F32, _F32])
    if fn is None:
        return None

    def run(x: torch.Tensor, token: torch.Tensor, offsets: torch.Tensor, slot_w: torch.Tensor,
            w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
            w2_scale: torch.Tensor, out: torch.Tensor,
            act: GLUActivation | None = None) -> torch.Tensor:
        """As moe_experts_kernel's run, with the experts' weights in the checkpoint's MXFP4
        layout (uint8, contiguous): w13_packed [E,2I,H/2] (rows w1 = gate, then w3 = up),
        w13_scale [E,2I,H/32], w2_packed [E,H,I/2], w2_scale [E,H,I/32] (kdaserve.ops.mxfp4).
        H and I must be multiples of 32. x, slot_w, out fp32. Returns out."""
        E, I2, H2 = w13_packed.shape
        H, I = 2 * H2, I2 // 2
        assert H % 32 == 0 and I % 32 == 0 and I2 % 2 == 0, (
            f"the MXFP4 expert kernel needs hidden and intermediate sizes that are multiples "
            f"of 32 (one E8M0 scale per 32 inputs), got H={H}, I={I2 / 2:g}")
        x, token, offsets, slot_w = (t.contiguous() for t in (x, token, offsets, slot_w))
        weights = (w13_packed, w13_scale, w2_packed, w2_scale)
        assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in weights), (
            "MXFP4 expert weights must be contiguous uint8 tensors")
        assert w13_scale.shape == (E, I2, H // 32) and w2_packed.shape == (E, H, I // 2)
        assert w2_scale.shape == (E, H, I // 32), (
            f"MXFP4 expert shapes disagree: w13 {tuple(w13_packed.shape)}/"
            f"{tuple(w13_scale.shape)}, w2 {tuple(w2_packed.shape)}/{tuple(w2_scale.shape)}")
        assert all(t.dtype == torch.float32 for t in (x, slot_w, out)) and out.is_contiguous()
        assert token.dtype == offsets.dtype == torch.int64 and offsets.numel() == E + 1
        assert x.dim() == 2 and x.shape[1] == H == out.shape[1] and out.shape[0] == x.shape[0]
        assert slot_w.numel() == token.numel()
        parallel_rows("moe_cpu.c", fn, x.shape[0], token.numel() * I2, E, H, I, _ptr(x),
                      _ptr(token), _ptr(offsets), _ptr(slot_w), *(_ptr(t) for t in weights),
                      _ptr(out), *activation_args(act), pool=False)
        return out

    return run
