"""The compiled routed experts over INT8/INT4 stacks (csrc/moe_int.h) against the torch
oracle (each expert dequantized, then its MLP), and each token independent of its batch."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import needs_kernels, require
from tiny_models import random_model, tiny_config

from kdaserve.model.quantize import quantize_model
from kdaserve.ops import cpu_int_linear
from kdaserve.quant_config import WeightQuant

pytestmark = needs_kernels


def _moe(wq: WeightQuant):
    cfg = tiny_config(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                      kv_lora_rank=32, num_experts=6, num_experts_per_token=3)
    return quantize_model(random_model(cfg), wq).model.layers[1].block_sparse_moe


def _slots(ids: torch.Tensor, weights: torch.Tensor, experts: int):
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order // ids.shape[1], offsets, weights.reshape(-1)[order].contiguous()


@pytest.mark.parametrize("wq", [WeightQuant(8, 32), WeightQuant(4, 32),
                                WeightQuant(4, 16, symmetric=False), WeightQuant(8, 128)],
                         ids=["int8", "int4", "int4-asym", "int8-rowgroups"])
def test_int_experts_match_the_oracle_and_their_batch(wq) -> None:
    moe = _moe(wq)
    kernel = require(cpu_int_linear.experts_kernel(), "the INT expert kernel (moe_int.h)")
    g = torch.Generator().manual_seed(wq.bits)
    T = 11
    x = torch.randn(T, 64, generator=g)
    weights, ids = moe.gate(x)
    token, offsets, slot_w = _slots(ids, weights, moe.num_experts)
    out = kernel(x, token, offsets, slot_w, moe, torch.zeros_like(x), act=moe.act)
    ref = torch.zeros_like(x)
    with torch.no_grad():
        for t in range(T):
            for j in range(ids.shape[1]):
                w13, w2 = moe._expert(int(ids[t, j]), torch.float32)
                ref[t] += weights[t, j] * moe._expert_mlp(x[t:t + 1], w13, w2)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for t in range(T):      # each token alone: the same bits
        tk, off, sw = _slots(ids[t:t + 1], weights[t:t + 1], moe.num_experts)
        alone = kernel(x[t:t + 1], tk, off, sw, moe, torch.zeros(1, 64), act=moe.act)
        assert torch.equal(alone[0], out[t])


def test_the_moe_layer_takes_the_kernel() -> None:
    moe = _moe(WeightQuant(4, 32))
    x = torch.randn(5, 64)
    assert moe._ragged_kernel(x) is cpu_int_linear.experts_kernel() is not None
