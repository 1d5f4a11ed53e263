"""The compiled routed experts over INT8/INT4 stacks (csrc/moe_int.h) against the torch
oracle, and each token independent of its batch. The oracle: each expert dequantized, then its
MLP (the fp32 decode, KDASERVE_INT_DOT=0); with the integer dots (the default), its products
where they apply through int_quant.int_dot_oracle."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import needs_kernels, require
from tiny_models import random_model, tiny_config

from kdaserve.model.quantize import quantize_model
from kdaserve.ops import cpu_int_linear
from kdaserve.ops.int_quant import dequantize, int_dot_applies, int_dot_oracle
from kdaserve.quant_config import WeightQuant

pytestmark = needs_kernels


def _moe(wq: WeightQuant, moe_intermediate: int = 48):
    cfg = tiny_config(hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=moe_intermediate,
                      kv_lora_rank=32, num_experts=6, num_experts_per_token=3)
    return quantize_model(random_model(cfg), wq).model.layers[1].block_sparse_moe


def _slots(ids: torch.Tensor, weights: torch.Tensor, experts: int):
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order // ids.shape[1], offsets, weights.reshape(-1)[order].contiguous()


def _product(x, moe, stack: str, e: int, k: int, int_dot: bool) -> torch.Tensor:
    wq = moe.int_quant
    packed, scale = getattr(moe, f"{stack}_packed")[e], getattr(moe, f"{stack}_scale")[e]
    zero = getattr(moe, f"{stack}_zero_point", None)
    zero = None if zero is None else zero[e]
    if int_dot and int_dot_applies(k, wq.group_size, wq.bits):
        return int_dot_oracle(x, packed, scale, zero, wq.bits, k, wq.group_size)
    return x @ dequantize(packed, scale, zero, wq.bits, k, wq.group_size).t()


@pytest.mark.parametrize("int_dot", [True, False], ids=["int-dot", "fp32-decode"])
@pytest.mark.parametrize("wq,inter", [(WeightQuant(8, 32), 48), (WeightQuant(4, 32), 64),
                                      (WeightQuant(4, 16, symmetric=False), 48),
                                      (WeightQuant(8, 128), 48),
                                      (WeightQuant(4, 64, symmetric=False), 64)],
                         ids=["int8", "int4", "int4-asym16", "int8-rowgroups", "int4-asym64"])
def test_int_experts_match_the_oracle_and_their_batch(wq, inter, int_dot, monkeypatch) -> None:
    monkeypatch.setenv("KDASERVE_INT_DOT", str(int(int_dot)))
    moe = _moe(wq, inter)
    kernel = require(cpu_int_linear.experts_kernel(), "the INT expert kernel (moe_int.h)")
    g = torch.Generator().manual_seed(wq.bits)
    T = 11
    x = torch.randn(T, 64, generator=g)
    weights, ids = moe.gate(x)
    token, offsets, slot_w = _slots(ids, weights, moe.num_experts)
    out = kernel(x, token, offsets, slot_w, moe, torch.zeros_like(x), act=moe.act)
    ref = torch.zeros_like(x)
    I = moe.intermediate
    with torch.no_grad():
        for t in range(T):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                h = _product(x[t:t + 1], moe, "experts_w13", e, 64, int_dot)
                h = moe.act(h[..., :I], h[..., I:])
                ref[t] += weights[t, j] * _product(h, moe, "experts_w2", e, I, int_dot)[0]
    # the same products (bit for bit, tests/ops/test_cpu_int_linear.py); the activation and
    # the sum over experts in other orders
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for t in range(T):      # each token alone: the same bits
        tk, off, sw = _slots(ids[t:t + 1], weights[t:t + 1], moe.num_experts)
        alone = kernel(x[t:t + 1], tk, off, sw, moe, torch.zeros(1, 64), act=moe.act)
        assert torch.equal(alone[0], out[t])


def test_the_moe_layer_takes_the_kernel() -> None:
    moe = _moe(WeightQuant(4, 32))
    x = torch.randn(5, 64)
    assert moe._ragged_kernel(x) is cpu_int_linear.experts_kernel() is not None
