"""RoPE forms: interleaved pairs are rotate-half on permuted dims; YaRN at factor 1 is plain;
YaRN's softmax scale and ramp on the released K3 DSpark settings."""

from __future__ import annotations

import math

import torch

from kdaserve.ops.rope import apply_rope, rope_frequencies, softmax_scale

K3_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_interleaved_is_rotate_half_on_permuted_dims():
    x = torch.randn(5, 3, 16)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])    # pairs -> halves
    a = apply_rope(x, pos, 10000.0, interleaved=True)[..., perm]
    b = apply_rope(x[..., perm], pos, 10000.0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_yarn_factor_one_is_plain():
    x = torch.randn(4, 2, 8)
    pos = torch.arange(4) * 33
    plain = apply_rope(x, pos, 500.0, interleaved=True)
    yarn = apply_rope(x, pos, 500.0, interleaved=True, scaling={**K3_YARN, "factor": 1.0})
    torch.testing.assert_close(plain, yarn, rtol=0, atol=0)


def test_yarn_k3_settings():
    inv, mult = rope_frequencies(64, 50000.0, K3_YARN)
    plain, _ = rope_frequencies(64, 50000.0)
    assert mult == 1.0                        # mscale / mscale_all_dim
    # dims below the correction range (15) keep their frequency, above it (26) are / factor
    torch.testing.assert_close(inv[:15], plain[:15])
    torch.testing.assert_close(inv[26:], plain[26:] / 32)
    assert abs(softmax_scale(192, K3_YARN) - 192 ** -0.5 * (0.1 * math.log(32) + 1) ** 2) < 1e-12
    assert softmax_scale(192, None) == 192 ** -0.5
