"""The interpreter harness itself: a trivial kernel runs and gives exact results."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _axpy(x_ptr, y_ptr, o_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(o_ptr + offs, a * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m),
             mask=m)


def test_axpy_exact(device):
    x = torch.arange(300, dtype=torch.float32, device=device)
    y = torch.ones(300, device=device)
    o = torch.empty_like(x)
    _axpy[(triton.cdiv(300, 128),)](x, y, o, 2.0, 300, BLOCK=128)
    assert torch.equal(o, 2 * x + 1)
