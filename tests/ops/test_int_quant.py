"""The INT8/INT4 packing math (kdaserve/ops/int_quant.py): bytes identical to
compressed-tensors' packing, round trips, and the quantization error bound."""

from __future__ import annotations

import pytest
import torch

from kdaserve.ops import int_quant as iq

ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [8, 12, 48, 64, 100])
def test_packing_is_compressed_tensors_bytes(bits: int, k: int) -> None:
    g = torch.Generator().manual_seed(k * bits)
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (5, k), generator=g, dtype=torch.int8)
    ours = iq.pack(q, bits)
    assert ours.shape == (5, iq.row_bytes(k, bits))
    assert torch.equal(iq.from_int32_words(ct_helpers.pack_to_int32(q, bits)), ours)
    assert torch.equal(iq.to_int32_words(ours), ct_helpers.pack_to_int32(q, bits))
    assert torch.equal(iq.unpack(ours, bits, k), q.to(torch.int16))
    zero = torch.randint(lo, -lo, (k, 3), generator=g, dtype=torch.int8)
    packed_zero = ct_helpers.pack_to_int32(zero, bits, packed_dim=0)
    assert torch.equal(iq.pack_zero_points(zero, bits), packed_zero)
    assert torch.equal(iq.unpack_zero_points(packed_zero, bits, k), zero)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k,group", [(64, 32), (48, 32), (96, 128), (40, 16)])
def test_quantize_error_within_half_a_step(bits: int, symmetric: bool, k: int,
                                           group: int) -> None:
    w = torch.randn(7, k, generator=torch.Generator().manual_seed(k + bits)) * 0.2
    packed, scale, zero = iq.quantize(w, bits, group, symmetric)
    eff = min(group, k)
    assert scale.shape == (7, iq.num_groups(k, eff)) and scale.dtype == torch.float32
    assert (zero is None) == symmetric
    deq = iq.dequantize(packed, scale, zero, bits, k, group)
    step = scale.repeat_interleave(eff, -1)[:, :k]
    # round to nearest: each weight within half a step (plus fp32 rounding of the product)
    assert ((deq - w).abs() <= step * (0.5 + 1e-5)).all()


def test_dequantize_matches_compressed_tensors() -> None:
    """Our dequantize of a compressed-tensors-quantized weight equals the package's own."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    for bits, symmetric in ((4, True), (8, True), (4, False)):
        args = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy="group",
                                group_size=32)
        g = w.view(6, 2, 32)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        q = quantize(w, scale, zp, args, dtype=torch.int8)
        theirs = dequantize(q, scale, zp if not symmetric else None, args)
        packed = iq.from_int32_words(ct_helpers.pack_to_int32(q, bits))
        ours = iq.dequantize(packed, scale.float(), None if symmetric else zp.to(torch.int8),
                             bits, 64, 32)
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-6)


def test_all_zero_group_and_channel_groups() -> None:
    w = torch.zeros(2, 64)
    w[1, 40] = 1.0
    packed, scale, zero = iq.quantize(w, 4, 32)
    assert torch.equal(iq.dequantize(packed, scale, zero, 4, 64, 32), w)
    packed, scale, _ = iq.quantize(w, 8, 1 << 30)             # one group per row
    assert scale.shape == (2, 1)
    assert torch.equal(iq.dequantize(packed, scale, None, 8, 64, 1 << 30), w)
