"""The compiled linear layers over K-major weights (kdaserve.ops.cpu_linear) against F.linear,
their reference: same products to rounding, each row independent of its batch, and the
model's inference storage (fuse_for_inference) giving the same logits as the model as built."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from compiled_kernels import needs_kernels, require
from tiny_models import random_model, tiny_config

from kdaserve.model.fused_args import BlockArgs
from kdaserve.model.kda import KimiDeltaAttention
from kdaserve.ops.cpu_linear import KMajorLinear, _kernel, k_major, k_major_weight, linear

pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _built():
    require(_kernel(), "the K-major linear kernel (csrc/row_products.h)")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # one running sum over K against MKL's blocked sums: relative rounding of ~1e-6
    scale = b.abs().max().item() + 1e-6
    assert (a - b).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("rows,out,inner", [(1, 900, 256), (5, 33, 64), (7, 16, 5),
                                            (150, 96, 256), (301, 40, 17), (0, 32, 8)])
def test_matches_f_linear(rows, out, inner):
    g = torch.Generator().manual_seed(rows + out)
    x = torch.randn(rows, inner, generator=g)
    w = torch.randn(out, inner, generator=g)
    wk = k_major_weight(w)
    assert k_major(wk) and torch.equal(wk, w)
    y = linear(x, wk)
    assert y.shape == (rows, out)
    if rows:
        _close(y, F.linear(x, w))


# matmat_t's paths: up to 4 rows streamed, tiles split by outputs, then by rows; a matrix of
# 2 MiB and more sums in two K halves (ksplit.h) on each of them
BATCH_CASES = [(4, 48, 64), (12, 48, 64), (200, 48, 64), (7, 1024, 1024)]


@pytest.mark.parametrize("rows,out,inner", BATCH_CASES)
def test_rows_do_not_depend_on_their_batch(rows, out, inner):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inner, generator=g)
    wk = k_major_weight(torch.randn(out, inner, generator=g))
    whole = linear(x, wk)
    for r in (0, rows // 2, rows - 1):
        assert torch.equal(linear(x[r:r + 1], wk)[0], whole[r])
    for n in {2, 3, 4, rows // 3}:
        assert torch.equal(linear(x[:n], wk), whole[:n])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 32])
def test_tail_outputs_sum_as_the_tiles_do(rows):
    """The last N % 16 outputs (900 = 56 x 16 + 4) run through a padded strip of the tiles:
    the same bits as when they lie inside a wider matrix's tiles (zero columns appended)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g)
    w = torch.randn(900, 256, generator=g)
    wide = torch.cat([w, torch.zeros(12, 256)])
    assert torch.equal(linear(x, k_major_weight(w)), linear(x, k_major_weight(wide))[:, :900])


def test_padded_store_gives_the_same_bits():
    """pad=True spaces fp32 rows of 4 KiB multiples one cache line further apart (the LM
    head's store): still a K-major view, and every product the same bits as the compact
    store. bf16 stores stay compact."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(1024, 64, generator=g)
    padded, compact = k_major_weight(w, pad=True), k_major_weight(w)
    assert k_major(padded) and padded.stride(1) == 1024 + 16
    assert torch.equal(padded, w) and compact.stride(1) == 1024
    assert k_major_weight(w[:40], pad=True).stride(1) == 40        # 4 KiB multiples only
    assert k_major_weight(w.bfloat16(), pad=True).stride(1) == 1024
    for rows in (1, 3, 8, 32, 130):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(linear(x, padded), linear(x, compact)), rows


def test_leading_dims_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 40, generator=g)[..., :32]          # rows 40 floats apart
    w = torch.randn(24, 32, generator=g)
    y = linear(x, k_major_weight(w))
    assert y.shape == (2, 5, 24)
    _close(y, F.linear(x, w))


def test_everything_else_is_f_linear():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 16, generator=g)
    w = torch.randn(20, 16, generator=g)
    assert torch.equal(linear(x, w), F.linear(x, w))                   # row-major weight
    wb = w.to(torch.bfloat16)                                            # bf16, row-major
    assert torch.equal(linear(x.bfloat16(), wb), F.linear(x.bfloat16(), wb))
    wk = k_major_weight(w).requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    y = linear(xg, wk)
    y.sum().backward()                                                  # autograd: F.linear
    assert xg.grad is not None and wk.grad is not None


def test_inference_storage_keeps_the_model():
    cfg = tiny_config()
    model = random_model(cfg, seed=2)
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.fuse_for_inference()
    # same parameters, names and shapes: only their memory layout changed
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    swapped = [m for m in model.modules() if isinstance(m, KMajorLinear)]
    assert swapped and all(k_major(m.weight) for m in swapped)
    # the fused decode blocks read that memory in place: no transposed copy
    args = BlockArgs(model)
    assert all(args._wt(m.weight).value == m.weight.data_ptr() for m in swapped)
    for layer in model.model.layers:
        if isinstance(layer.self_attn, KimiDeltaAttention):
            assert k_major(layer.self_attn._fused)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        assert not k_major(model.model.embed_tokens.weight)
    g = torch.Generator().manual_seed(6)
    for m, r in zip(model.modules(), ref.modules()):
        if isinstance(m, KMajorLinear):
            x = torch.randn(9, m.in_features, generator=g)
            _close(m(x), r(x))


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_bf16_weights_sum_in_fp32(rows):
    """bf16 weights K-major: fp32 sums over the widened weights, rounded once to the input's
    dtype (torch's bf16 product rounds its own way, and crawls on CPUs without bf16 units)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    wb = k_major_weight(torch.randn(40, 96, generator=g).bfloat16())
    assert k_major(wb) and wb.dtype == torch.bfloat16
    y = linear(x, wb)
    assert y.dtype == torch.bfloat16
    exact = F.linear(x.double(), wb.double())
    # fp32 sums (relative ~1e-6) then one bf16 rounding (2^-8 relative)
    assert ((y.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-4).all()
    assert torch.equal(linear(x[:1], wb)[0], y[0])         # a row alone: the same bits


def test_bf16_models_are_stored_k_major_and_gpu_models_left_alone():
    model = random_model(tiny_config(), seed=5).to_dtype(torch.bfloat16)
    ref = copy.deepcopy(model)
    model.fuse_for_inference()
    swapped = [m for m in model.modules() if isinstance(m, KMajorLinear)]
    assert swapped and all(k_major(m.weight) and m.weight.dtype == torch.bfloat16
                           for m in swapped)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    if torch.cuda.is_available():
        gpu = random_model(tiny_config(), seed=5).cuda().fuse_for_inference()
        assert not any(isinstance(m, KMajorLinear) for m in gpu.modules())


def test_thread_count_does_not_change_the_product():
    """Many rows split over torch's threads by rows (linear_rows): one thread and two agree
    bitwise, and the count is torch's, passed in (not the calling thread's OpenMP default)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(300, 64, generator=g)
    wk = k_major_weight(torch.randn(40, 64, generator=g))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, wk)
        torch.set_num_threads(2)
        two = linear(x, wk)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_matrices_sum_in_two_halves_whatever_the_rows_and_threads(dtype):
    """A matrix of 2 MiB or more sums each output over the two halves of K (csrc/ksplit.h):
    one or two rows split the halves over the threads, more rows run the tiles; every row
    gets the same bits either way, and in fp32 exactly the sum of the two halves' products
    (each half, 1 MiB, one running sum)."""
    require(_kernel(), "csrc/decode_cpu.c")
    g = torch.Generator().manual_seed(3)
    N, K = 1000, 1024 if dtype == torch.float32 else 2048      # 1000: a 16-output tail
    w = k_major_weight(torch.randn(N, K, generator=g).to(dtype))
    x = torch.randn(103, K, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = linear(x, w)
        for t in (1, 2):
            torch.set_num_threads(t)
            for b in (1, 2, 3, 7):
                assert torch.equal(linear(x[:b], w), full[:b]), (t, b)
    finally:
        torch.set_num_threads(threads)
    if dtype == torch.float32:
        h = K // 2
        halves = (linear(x[:, :h].contiguous(), k_major_weight(w[:, :h]))
                  + linear(x[:, h:].contiguous(), k_major_weight(w[:, h:])))
        assert torch.equal(full, halves)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), rtol=2e-2,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("N,K", [(1024, 1024), (1000, 2048), (48, 130), (1040, 1026),
                                 (96, 64), (33, 17)])
def test_bf16_rows_give_the_bits_of_widened_rows(N, K):
    """bf16 rows of a bf16 weight (a bf16 model's prefill) go to the C side as they are, which
    widens them and, on a CPU with AVX-512 BF16, runs its tiles as dot products of pairs
    (csrc/pair_tiles.h): every row and batch the same bits as the fp32 rows' product, over
    shapes that run pair tiles, fp32 tiles, streamed rows, K halves of odd length and tails."""
    import ctypes

    from kdaserve.ops import cpu_isa
    from kdaserve.ops.cpu_kernels import _c_function
    from kdaserve.ops.cpu_linear import _kernel_x16

    x16, f32 = require(_kernel_x16(), "linear_rows_x16_bf16"), _kernel(torch.bfloat16)
    built = _c_function("decode_cpu.c", "pair_tiles_built_bf16", [])
    built.restype = ctypes.c_int64
    if cpu_isa.requested() == "native" and "avx512_bf16" in cpu_isa.cpu_flags():
        assert built() == 1                # the dot products are not silently off
    g = torch.Generator().manual_seed(N + K)
    w = k_major_weight(torch.randn(N, K, generator=g).bfloat16())
    x = torch.randn(103, K, generator=g).bfloat16()
    xf = x.float()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for b in (1, 2, 5, 6, 7, 32, 103):
                want, got = torch.empty(b, N), torch.empty(b, N)
                f32(b, N, K, xf.data_ptr(), K, w.data_ptr(), w.stride(1), want.data_ptr(), N, t)
                assert x16(b, N, K, x.data_ptr(), K, w.data_ptr(), w.stride(1),
                           got.data_ptr(), N, t) == 0
                assert torch.equal(got, want), (t, b)
    finally:
        torch.set_num_threads(threads)
    # and the layer gives them back rounded once, as before
    assert torch.equal(linear(x, w), want.bfloat16())
