"""Weight-only INT8 / INT4 with group-wise scales: the packing math and the torch oracle.

A weight [..., N, K] is stored as
- `packed` uint8 [..., N, row_bytes(K)]: each row's integers q in [-2^(b-1), 2^(b-1)) offset to
  unsigned (q + 2^(b-1)); INT8 one per byte, INT4 two per byte with the even column in the low
  nibble; a row is padded to a whole number of 32-bit words (zeros past K). These are exactly
  the little-endian bytes of compressed-tensors' `pack_to_int32` words (32 values in `b` words,
  value i at bit i*b), so a `weight_packed` int32 tensor is read with a view, not a copy;
- `scale` fp32 [..., N, G], G = ceil(K / group): one per `group` consecutive columns of a row
  (the last group may be shorter);
- `zero` int8 [..., N, G] or None (symmetric): w = (q - zero) * scale.
Dequantized, each weight is (q - zero) * scale rounded once to fp32: the oracle's weight, and
what the compiled kernels multiply by (kdaserve/ops/cpu_int_linear.py).
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":   # the int32 <-> byte views below assume it
    raise ImportError("kdaserve's packed integer weights need a little-endian host")


def row_bytes(k: int, bits: int) -> int:
    """Bytes of one packed row of k values (whole 32-bit words, as compressed-tensors packs)."""
    return 4 * ((k * bits + 31) // 32)


def num_groups(k: int, group: int) -> int:
    return (k + group - 1) // group


def unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """packed uint8 [..., row_bytes] -> q int16 [..., k] (signed)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed weights must be uint8, got {packed.dtype}")
    b = packed.to(torch.int16)
    if bits == 8:
        return b[..., :k] - 128
    codes = torch.stack([b & 0x0F, b >> 4], -1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return codes[..., :k] - 8


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q integers [..., k] in [-2^(b-1), 2^(b-1)) -> packed uint8 [..., row_bytes(k)]."""
    k = q.shape[-1]
    lo = -(1 << (bits - 1))
    if q.numel() and (int(q.min()) < lo or int(q.max()) >= -lo):
        raise ValueError(f"values outside INT{bits}")
    u = (q.to(torch.int16) - lo).to(torch.uint8)
    per_byte = 8 // bits
    pad = row_bytes(k, bits) * per_byte - k
    if pad:
        u = torch.cat([u, u.new_zeros(*u.shape[:-1], pad)], -1)
    if bits == 8:
        return u.contiguous()
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def _expand(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[..., G] per-group values -> [..., k] per column."""
    return t.repeat_interleave(group, -1)[..., :k]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               bits: int, k: int, group: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The stored weight as floats [..., N, k]: (q - zero) * scale, rounded once in fp32
    (a group past k is one group of the whole row: compressed-tensors' channel strategy)."""
    group = min(group, k)
    if scale.shape[-1] != num_groups(k, group):
        raise ValueError(f"{scale.shape[-1]} scale groups do not fit {k} columns in groups "
                         f"of {group}")
    q = unpack(packed, bits, k)
    if zero is not None:
        q = q - _expand(zero.to(torch.int16), group, k)
    w = q.float() * _expand(scale.float(), group, k)
    return w.to(dtype)


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [..., N, K] float -> (packed, scale fp32, zero int8 or None), round to nearest (ties
    to even). Symmetric: scale = amax / (2^(b-1) - 1), so +-amax are representable and nothing
    clips. Asymmetric: the group's [min, max] (widened to hold 0) over all 2^b levels."""
    k = w.shape[-1]
    group = min(group, k)
    g = num_groups(k, group)
    pad = g * group - k
    x = w.float()
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], -1)
    x = x.reshape(*w.shape[:-1], g, group)
    qmax, qmin = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    if symmetric:
        scale = x.abs().amax(-1) / qmax
        zero = None
    else:
        lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        scale = (hi - lo) / (qmax - qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    if not symmetric:
        zero = (qmin - torch.round(lo / scale)).clamp(qmin, qmax)
        q = torch.round(x / scale.unsqueeze(-1)) + zero.unsqueeze(-1)
        zero = zero.to(torch.int8)
    else:
        q = torch.round(x / scale.unsqueeze(-1))
    q = q.clamp(qmin, qmax).reshape(*w.shape[:-1], g * group)[..., :k]
    return pack(q.to(torch.int16), bits), scale.contiguous(), zero


# ---- compressed-tensors tensors <-> the stored form -----------------------------------------

def from_int32_words(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors `weight_packed` int32 [..., N, words] -> uint8 [..., N, 4*words]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"weight_packed must be int32, got {packed.dtype}")
    return _dense(packed).view(torch.uint8)


def to_int32_words(packed: torch.Tensor) -> torch.Tensor:
    return _dense(packed).view(torch.int32)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides (a contiguous tensor's size-1 dims may carry any stride, which
    a view to another element size refuses)."""
    strides = [1] * t.dim()
    for d in range(t.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * t.shape[d + 1]
    if list(t.stride()) == strides:
        return t
    return t.reshape(-1).clone().view(t.shape)


def unpack_zero_points(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """compressed-tensors packs zero points [N, G] along the rows (dim 0): int32
    [words(N), G] -> int8 [N, G]."""
    if packed.dtype != torch.int32:       # stored unpacked (INT8 as int8, or a plain form)
        return packed.to(torch.int8)
    cols = from_int32_words(packed.t().contiguous())          # [G, bytes]
    return unpack(cols, bits, rows).t().to(torch.int8).contiguous()


def pack_zero_points(zero: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [N, G] -> int32 [words(N), G] packed along the rows (compressed-tensors')."""
    return to_int32_words(pack(zero.t(), bits)).t().contiguous()


# ---- the integer dots of decode rows (csrc/int_dot.h), in torch -----------------------------

ACT_BLOCK = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] fp32 (K a multiple of 32) -> (codes int8 [..., K], block scales fp32
    [..., K/32]): d = amax / 127 per block of 32, codes = round(x * (1 / d)) (ties to even),
    the fp32 operations of csrc/int_acts.h qacts_make, so the same bits."""
    blocks = x.float().reshape(*x.shape[:-1], -1, ACT_BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)),
                      torch.zeros_like(d))
    codes = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return codes.reshape(x.shape), d


def unit_columns(bits: int) -> int:
    """Columns of one 32-byte unit of a packed row (csrc/int_dot.h): 8 lanes of them."""
    return 64 if bits == 4 else 32


def int_dot_applies(k: int, group: int, bits: int) -> bool:
    """Whether csrc/int_dot.h takes a product of k columns (else the fp32 decode does)."""
    group, unit = min(group, k), unit_columns(bits)
    return k % unit == 0 and (group % unit == 0 or (bits == 4 and group == 32))


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, rounded once: a*b is exact in float64, the sum's error is
    kept exactly (TwoSum), and a tie of the float64 sum between two floats is broken by it."""
    s, c = a.double() * b.double(), c.double().expand_as(a)
    hi = s + c
    bb = hi - s
    err = (s - (hi - bb)) + (c - bb)
    r = hi.float()
    diff = hi - r.double()
    toward = torch.nextafter(r, torch.where(diff > 0, torch.tensor(float("inf")),
                                            torch.tensor(float("-inf"))))
    tie = (diff != 0) & (diff.abs() == (toward.double() - r.double()).abs() / 2)
    return torch.where(tie & (err * diff > 0), toward, r)


def int_dot_oracle(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor | None, bits: int, k: int, group: int) -> torch.Tensor:
    """x [..., k] @ the stored weight [N, k]^T as csrc/int_dot.h computes it, bit for bit:
    each row's activations to int8 blocks (quantize_activations); per unit of 32 weight bytes
    (unit_columns) 8 lanes of consecutive columns, each lane's exact integer sum of
    (q - zero) * code; per lane and group t = fma(I, d_block, t) over the group's units, then
    acc = fma(t, scale, acc); the 8 lanes summed ((0+4)+(2+6))+((1+5)+(3+7))."""
    group = min(group, k)
    if not int_dot_applies(k, group, bits):
        raise ValueError(f"no integer dots for {k} columns in groups of {group} (INT{bits})")
    unit = unit_columns(bits)
    cpl, units = unit // 8, k // unit
    codes, d = quantize_activations(x.reshape(-1, k))
    q = unpack(packed, bits, k).double()
    if zero is not None:
        q = q - _expand(zero.double(), group, k)
    a = codes.double().reshape(-1, units, 8, cpl)
    lanes = torch.einsum("bulc,nulc->bnul", a, q.reshape(-1, units, 8, cpl)).float()  # exact
    first = torch.arange(units).unsqueeze(1) * unit + torch.arange(8) * cpl   # [U, 8] columns
    dl = d[:, first // ACT_BLOCK]                                             # [B, U, 8]
    lane_group = first // group
    rows, n = a.shape[0], q.shape[0]
    acc = torch.zeros(rows, n, 8)
    for g in range(scale.shape[-1]):
        t = torch.zeros(rows, n, 8)
        for u in range((g * group) // unit, min(((g + 1) * group - 1) // unit + 1, units)):
            mine = lane_group[u] == g
            t = torch.where(mine, _fma(lanes[:, :, u], dl[:, None, u], t), t)
        mine = (lane_group == g).any(0)
        acc = torch.where(mine, _fma(t, scale[None, :, g, None].float(), acc), acc)
    s = acc.unbind(-1)
    y = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
    return y.reshape(*x.shape[:-1], n)
