"""Linear layers over packed INT8/INT4 weights on the CPU (kdaserve/model/quant_linear.py):
the product reads the packed bytes and group scales in place (csrc/int_rows.h), so a decode
step reads a quarter (INT8) or an eighth (INT4) of an fp32 weight's bytes.

Each pass decodes a few weight rows to fp32 exactly as the oracle dequantizes them and runs
every input row's dot products against them, each in one fixed order: a row's output does not
depend on the other rows of its call. Many rows (a prefill) amortise a whole dequantized
weight instead, so they take the oracle, dequantize-then-matmul, whose product torch runs at
its full speed. Everything else (other dtypes and devices, autograd) takes the oracle too."""

from __future__ import annotations

from functools import cache

import torch

from kdaserve.ops.cpu_kernels import _I64, _PTR, _c_function

# rows from which the dequantized weight's product beats decoding in the product (one
# dequantization of N*K weights against N*K*rows multiply-adds)
MAX_ROWS = 64


@cache
def _kernel():
    return _c_function("int_linear_cpu.c", "int_linear_rows",
                       [_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                        _PTR, _I64, _I64])


def available() -> bool:
    return _kernel() is not None


def applies(x: torch.Tensor, layer) -> bool:
    """Whether `layer`(x) takes the compiled product."""
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() <= MAX_ROWS * layer.in_features
            and not (torch.is_grad_enabled() and x.requires_grad)
            and layer.weight_packed.device.type == "cpu" and _kernel() is not None)


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] through the compiled product over layer's packed weight
    (a QuantLinear: weight_packed, weight_scale, weight_zero_point, bits, group)."""
    return rows_product(x, layer.weight_packed, layer.weight_scale, layer.weight_zero_point,
                        layer.bits, layer.group, layer.out_features)


def rows_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor | None, bits: int, group: int, n: int) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    for t in (packed, scale) + (() if zero is None else (zero,)):
        if not t.is_contiguous():
            raise ValueError("packed weights must be contiguous")
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        _kernel()(rows.shape[0], n, k, rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                  packed.shape[-1], scale.data_ptr(), None if zero is None else zero.data_ptr(),
                  scale.shape[-1], min(group, k), bits, out.data_ptr(), n,
                  torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
