"""FP8 latent rows (kdaserve/ops/fp8_latents.py): e4m3 values with a per-token fp32 scale
in the row's last four bytes."""

from __future__ import annotations

import torch

from kdaserve.ops import fp8_latents as f8


def test_pack_and_read_keep_each_token_to_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    # tokens of very different sizes in one batch: each keeps its own relative precision
    lat = torch.randn(6, 80, generator=g) * torch.tensor([1e-3, 1, 10, 300, 1e4, 1])[:, None]
    lat[5] = 0.0
    packed = f8.pack(lat)
    assert packed.dtype == torch.uint8 and packed.shape == (6, f8.packed_width(80))
    back = f8.read(packed)
    err = (back - lat).abs().amax(-1)
    size = lat.abs().amax(-1)
    assert (err <= 2.0 ** -4 * size).all()          # 3 mantissa bits: half a step at most
    assert torch.equal(back[5], torch.zeros(80))
    assert f8.read(packed, torch.bfloat16).dtype == torch.bfloat16
    # the scale is the token's largest magnitude over 448: that value is exact
    top = lat.abs().argmax(-1)
    assert torch.allclose(back[torch.arange(5), top[:5]], lat[torch.arange(5), top[:5]],
                          rtol=1e-6)


def test_rows_move_as_bytes():
    lat = torch.randn(4, 3, 20)
    packed = f8.pack(lat.reshape(-1, 20)).view(4, 3, -1)
    assert f8.is_packed(packed) and not f8.is_packed(lat)
    moved = packed[[2, 0]].clone()                   # a gather of whole rows, as the tiers do
    assert torch.equal(f8.read(moved), f8.read(packed)[[2, 0]])
    assert torch.equal(f8.as_float(lat, torch.float32), lat)
