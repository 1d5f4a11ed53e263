"""Which implementation the CUDA dispatch picks: our Triton kernels for decode where triton
imports, the references with KDASERVE_TRITON=0 (checked here on any machine: choosing needs
no GPU)."""

from __future__ import annotations

import pytest
import torch

from kdaserve.ops import gpu, registry
from kdaserve.ops import kda as kda_ref
from kdaserve.ops import mla as mla_ops
from kdaserve.ops.gpu.kda_decode import kda_recurrent_slots_triton

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh_choices(monkeypatch):
    """The choices are cached per process: rebuilt around the test. fla-core stays out
    (importing it costs seconds; its prefill is not what is chosen here)."""
    def no_fla():
        raise ImportError("fla-core left out of this test")

    monkeypatch.setattr(registry, "_fla_chunk_factory", no_fla)
    caches = (gpu.triton_available, registry._cuda_ops, registry._cuda_grad_ops,
              registry._interpreted_ops)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def test_cuda_decode_takes_the_kernels(fresh_choices):
    ops = registry._cuda_ops()
    assert ops.recurrent_slots is kda_recurrent_slots_triton
    assert ops.name == "torch+triton-decode" and ops.chunk is kda_ref.kda_chunk
    # training keeps the reference (the kernel has no autograd); prefill stays as it was
    grad = registry.kda_ops(torch.device("cuda"), needs_grad=True)
    assert grad.recurrent_slots is kda_ref.kda_recurrent_slots and grad.chunk is ops.chunk
    assert mla_ops.triton_paged_decode(torch.device("cuda"))


def test_kdaserve_triton_0_keeps_the_references(fresh_choices, monkeypatch):
    monkeypatch.setenv("KDASERVE_TRITON", "0")
    assert registry._cuda_ops() is registry.TORCH_KDA
    assert not mla_ops.triton_paged_decode(torch.device("cuda"))
    assert not mla_ops.triton_paged_decode(torch.device("cpu"))
    assert registry.kda_ops(torch.device("cpu")).recurrent_slots is not (
        kda_recurrent_slots_triton)
