"""The fused decode blocks' matrix arguments for a model with packed INT8/INT4 layers: each
matrix is a descriptor (csrc/int_rows.h `qmat`: packed rows, group scales, zero points, widths)
that the blocks' _q copy decodes inside its products (decode_cpu.c). A layer the checkpoint
left float is described as a plain fp32 [out, in] matrix (bits 32), so a model whose
quantization ignores some layers runs through the same blocks. The descriptors and the
tensors they point into are kept alive by the caller's `keep` list."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kdaserve.model.moe import SparseMoE
from kdaserve.model.quant_linear import QuantLinear
from kdaserve.ops.cpu_int_linear import int_dot


class QMat(ctypes.Structure):
    """int_rows.h's qmat, field for field."""
    _fields_ = [("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("groups", ctypes.c_int64), ("group", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("act8", ctypes.c_int64)]


def has_packed(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) or getattr(m, "int_quant", None) is not None
               for m in model.modules())


def packed_footprint(model: nn.Module) -> tuple[int, int]:
    """(bytes of the packed INT weights, the bits most of them have): what
    ops/stream_ahead.py tunes the lone row's prefetch for."""
    by_bits: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            by_bits[m.bits] = by_bits.get(m.bits, 0) + m.weight_packed.nbytes
        elif getattr(m, "int_quant", None) is not None:
            n = m.experts_w13_packed.nbytes + m.experts_w2_packed.nbytes
            by_bits[m.int_quant.bits] = by_bits.get(m.int_quant.bits, 0) + n
    if not by_bits:
        return 0, 0
    return sum(by_bits.values()), max(by_bits, key=by_bits.get)


class Descriptors:
    def __init__(self, keep: list) -> None:
        self.keep = keep

    def _fill(self, d: QMat, packed: torch.Tensor, scale: torch.Tensor | None,
              zero: torch.Tensor | None, group: int, bits: int) -> None:
        for t in (packed, scale, zero):
            if t is not None:
                assert t.is_contiguous() and t.device.type == "cpu"
                self.keep.append(t)
        d.packed, d.row_bytes = packed.data_ptr(), packed.shape[-1] * packed.element_size()
        d.scale = None if scale is None else scale.data_ptr()
        d.zero = None if zero is None else zero.data_ptr()
        d.groups = 0 if scale is None else scale.shape[-1]
        d.group, d.bits = group, bits
        d.act8 = int(bits != 32 and int_dot())

    def matrix(self, m: nn.Module | torch.Tensor) -> ctypes.c_void_p:
        """A descriptor of a layer (QuantLinear or float) or a float weight [out, in]."""
        d = QMat()
        if isinstance(m, QuantLinear):
            self._fill(d, m.weight_packed, m.weight_scale, m.weight_zero_point, m.group, m.bits)
        else:
            w = (m.weight if isinstance(m, nn.Module) else m).detach().float().contiguous()
            self._fill(d, w, None, None, 0, 32)
        self.keep.append(d)
        return ctypes.c_void_p(ctypes.addressof(d))

    def experts(self, moe: SparseMoE) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """(w13, w2): arrays of one descriptor per expert, [2I, W] and [W, I] each."""
        out = []
        for stack, k in (("experts_w13", moe.width), ("experts_w2", moe.intermediate)):
            arr = (QMat * moe.num_experts)()
            if moe.int_quant is not None:
                packed = getattr(moe, f"{stack}_packed")
                scale = getattr(moe, f"{stack}_scale")
                zero = getattr(moe, f"{stack}_zero_point", None)
                for e in range(moe.num_experts):
                    self._fill(arr[e], packed[e], scale[e], None if zero is None else zero[e],
                               min(moe.int_quant.group_size, k), moe.int_quant.bits)
            else:
                w = getattr(moe, stack).detach().float().contiguous()     # [E, rows, k]
                for e in range(moe.num_experts):
                    self._fill(arr[e], w[e], None, None, 0, 32)
            self.keep.append(arr)
            out.append(ctypes.c_void_p(ctypes.addressof(arr)))
        return out[0], out[1]
