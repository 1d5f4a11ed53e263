"""`QuantLinear`: a linear layer that keeps its weight packed as INT8 or INT4 with group-wise
scales (kdaserve/ops/int_quant.py), under compressed-tensors' names (`weight_packed`,
`weight_scale`, `weight_zero_point`), so a checkpoint's tensors load into it as they are.

Its product reads the packed bytes on CPU in fp32 (kdaserve/ops/cpu_int_linear.py); the
oracle, and the path everywhere else (other devices and dtypes, autograd), is the torch
dequantize-then-matmul. `weight` is the dequantized weight for code that reads it (MLA's
absorbed projections, shapes): a fresh tensor each time, never kept.
Legend: N outputs, K inputs, G scale groups per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.ops import cpu_int_linear
from kdaserve.ops.int_quant import dequantize, num_groups, quantize, row_bytes


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, group: int,
                 symmetric: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group = bits, min(group, in_features)
        self.dtype = dtype                  # of `weight` and of the oracle's product
        g = num_groups(in_features, self.group)
        self.register_buffer("weight_packed", torch.zeros(
            out_features, row_bytes(in_features, bits), dtype=torch.uint8))      # [N, bytes]
        self.register_buffer("weight_scale", torch.ones(out_features, g))       # [N, G] fp32
        self.register_buffer("weight_zero_point", None if symmetric else torch.zeros(
            out_features, g, dtype=torch.int8))                                 # [N, G]

    @classmethod
    def from_weight(cls, w: torch.Tensor, bits: int, group: int, symmetric: bool = True,
                    dtype: torch.dtype | None = None) -> QuantLinear:
        """w [N, K] quantized (round to nearest) into a new layer on w's device, computing in
        `dtype` (default: w's)."""
        n, k = w.shape
        m = cls(k, n, bits, group, symmetric, dtype=dtype or w.dtype).to(w.device)
        packed, scale, zero = quantize(w.detach(), bits, m.group, symmetric)
        m.weight_packed, m.weight_scale = packed, scale
        if zero is not None:
            m.weight_zero_point = zero
        return m

    @property
    def symmetric(self) -> bool:
        return self.weight_zero_point is None

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N, K] in `dtype` (default: the layer's)."""
        return dequantize(self.weight_packed, self.weight_scale, self.weight_zero_point,
                          self.bits, self.in_features, self.group, dtype or self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantized()

    @property
    def bias(self) -> None:
        return None

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.weight_packed, self.weight_scale, self.weight_zero_point)
                   if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_int_linear.applies(x, self):
            return cpu_int_linear.linear(x, self)
        return reference(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}, group={self.group}, symmetric={self.symmetric}")


def reference(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """The oracle: the dequantized weight through F.linear."""
    return F.linear(x, layer.dequantized(x.dtype))


def fuse_packed(layers: list[QuantLinear]) -> QuantLinear | None:
    """Layers of one input (a KDA layer's six input projections) as one QuantLinear over
    their rows in order, for the fused decode blocks; each layer's buffers become row views of
    its memory, so nothing is stored twice. None when their schemes differ."""
    first = layers[0]
    if len({(m.in_features, m.bits, m.group, m.symmetric) for m in layers}) != 1:
        return None
    fused = QuantLinear(first.in_features, sum(m.out_features for m in layers), first.bits,
                        first.group, first.symmetric, first.dtype)
    names = ["weight_packed", "weight_scale"] + ([] if first.symmetric else
                                                 ["weight_zero_point"])
    for name in names:
        whole = torch.cat([getattr(m, name) for m in layers], 0)
        setattr(fused, name, whole)
        start = 0
        for m in layers:
            setattr(m, name, whole[start:start + m.out_features])
            start += m.out_features
    return fused
