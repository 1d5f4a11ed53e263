"""Products over packed INT8/INT4 weights on the CPU: linear layers (kdaserve/model/
quant_linear.py) and routed experts (SparseMoE with int_quant, csrc/moe_int.h). For a layer:
the product reads the packed bytes and group scales in place (csrc/int_rows.h), so a decode
step reads a quarter (INT8) or an eighth (INT4) of an fp32 weight's bytes.

By default (integer dots, csrc/int_dot.h) each input row is quantized to int8 in blocks of 32
columns, as llama.cpp's Q8_0 / Q4_0 products do, and the weights stay integers: a block's
products sum exactly in int32, then meet the block and group scales in fp32
(int_quant.int_dot_oracle is the same math in torch). That needs the width and the group to be
multiples of 32; otherwise, and with KDASERVE_INT_DOT=0, each pass decodes a few weight rows
to fp32 exactly as the oracle dequantizes them and takes fp32 dot products. Either way each
(row, output) sums in one fixed order: a row's output does not depend on the other rows of its
call nor on the thread count. The integer dots take any number of rows (a prefill's chunk
too); the fp32 decode up to MAX_ROWS, past which a whole dequantized weight amortises over
them, so they take dequantize-then-matmul, whose product torch runs at its full speed.
Everything else (other dtypes and devices, autograd) takes that too: it is the oracle."""

from __future__ import annotations

import os
from functools import cache
from typing import TYPE_CHECKING

import torch

from kdaserve.ops.cpu_kernels import (
    _F32,
    _I64,
    _PTR,
    _c_function,
    _ptr,
    parallel_rows,
)
from kdaserve.ops.int_quant import int_dot_applies
from kdaserve.ops.moe_kernel import activation_args

if TYPE_CHECKING:
    from kdaserve.ops.activation import GLUActivation

# rows up to which the fp32 decode beats the dequantized weight's product (one dequantization
# of N*K weights against N*K*rows multiply-adds; on the AVX2 EPYC of docs/benchmarks.md)
MAX_ROWS = 64
# The integer dots take any number of rows. A row's result must not depend on how many rows
# share its call (greedy tokens identical across batching and chunking), and the dequantized
# product rounds otherwise: with a limit of 256 rows, a prompt of 300 tokens prefilled alone
# and the same prompt in a batch gave different greedy tokens (INT4 and INT8, Kimi Linear
# demo). They are also the faster up to a chunk's 2048 rows on the Zen 4 EPYC ([2048 x 1024],
# their time over the dequantized product's at 256 / 2048 rows: INT4 0.26 / 0.66, INT8 0.48-0.75
# / 0.81-1.07 with VNNI), except INT8 without VNNI (AVX2 1.17 at 2048 rows); docs/benchmarks.md,
# twenty-third session. Calls go to the kernel INT_DOT_SLICE rows at a time, which bounds the
# activation codes' memory and changes no row.
INT_DOT_SLICE = 2048


def int_dot() -> bool:
    """Whether decode rows take the integer dots (csrc/int_dot.h): KDASERVE_INT_DOT, default 1;
    0 keeps the fp32 products over the exactly dequantized weights."""
    return os.environ.get("KDASERVE_INT_DOT", "1") != "0"


@cache
def _kernel():
    return _c_function("int_linear_cpu.c", "int_linear_rows",
                       [_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                        _PTR, _I64, _I64, _I64])


def available() -> bool:
    return _kernel() is not None


def max_rows(layer) -> int | None:
    """The most rows `layer`'s compiled product takes (None: any number)."""
    if int_dot() and int_dot_applies(layer.in_features, layer.group, layer.bits):
        return None
    return MAX_ROWS


def applies(x: torch.Tensor, layer) -> bool:
    """Whether `layer`(x) takes the compiled product."""
    limit = max_rows(layer)
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and (limit is None or x.numel() <= limit * layer.in_features)
            and not (torch.is_grad_enabled() and x.requires_grad)
            and layer.weight_packed.device.type == "cpu" and _kernel() is not None)


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] through the compiled product over layer's packed weight
    (a QuantLinear: weight_packed, weight_scale, weight_zero_point, bits, group)."""
    return rows_product(x, layer.weight_packed, layer.weight_scale, layer.weight_zero_point,
                        layer.bits, layer.group, layer.out_features)


def rows_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, bits: int, group: int, n: int,
                 act8: bool | None = None) -> torch.Tensor:
    """act8: the integer dots (None: as int_dot() says)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    for t in (packed, scale) + (() if zero is None else (zero,)):
        if not t.is_contiguous():
            raise ValueError("packed weights must be contiguous")
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    for r0 in range(0, rows.shape[0], INT_DOT_SLICE):
        part = rows[r0:r0 + INT_DOT_SLICE]
        _kernel()(part.shape[0], n, k, part.data_ptr(), rows.stride(0), packed.data_ptr(),
                  packed.shape[-1], scale.data_ptr(), None if zero is None else zero.data_ptr(),
                  scale.shape[-1], min(group, k), bits, out[r0:].data_ptr(), n,
                  torch.get_num_threads(), int(int_dot() if act8 is None else act8))
    return out.view(*x.shape[:-1], n)


@cache
def _experts_kernel():
    return _c_function("moe_cpu.c", "moe_experts_int_rows",
                       [_I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR,
                        _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64,
                        _I64, _I64, _I64, _PTR, _I64, _F32, _F32])


def experts_kernel():
    """The compiled routed-expert MLPs over INT8/INT4 stacks (csrc/moe_int.h), or None."""
    return None if _experts_kernel() is None else experts


def experts(x: torch.Tensor, token: torch.Tensor, offsets: torch.Tensor,
            slot_w: torch.Tensor, moe, out: torch.Tensor,
            act: GLUActivation | None = None) -> torch.Tensor:
    """As moe_kernel.moe_experts_kernel's run, over `moe`'s INT stacks (a SparseMoE with
    int_quant: experts_w13_packed [E,2I,rb], _scale/_zero_point [E,2I,G], likewise w2)."""
    wq = moe.int_quant
    E, H, I = moe.num_experts, moe.width, moe.intermediate
    x, token, offsets, slot_w = (t.contiguous() for t in (x, token, offsets, slot_w))
    stacks = []
    for name in ("experts_w13", "experts_w2"):
        packed, scale = getattr(moe, f"{name}_packed"), getattr(moe, f"{name}_scale")
        zero = getattr(moe, f"{name}_zero_point", None)
        assert all(t is None or t.is_contiguous() for t in (packed, scale, zero))
        stacks += [_ptr(packed), _ptr(scale), _ptr(zero), packed.shape[-1], scale.shape[-1]]
    assert all(t.dtype == torch.float32 for t in (x, slot_w, out)) and out.is_contiguous()
    assert token.dtype == offsets.dtype == torch.int64 and offsets.numel() == E + 1
    assert x.dim() == 2 and x.shape[1] == H == out.shape[1]
    parallel_rows("moe_cpu.c", _experts_kernel(), x.shape[0], token.numel() * 2 * I, E, H, I,
                  _ptr(x), _ptr(token), _ptr(offsets), _ptr(slot_w), *stacks, wq.group_size,
                  wq.bits, int(int_dot()), _ptr(out), *activation_args(act), pool=False)
    return out
