"""The Triton paged MLA decode against the torch reference `mla_decode_split_k_torch`."""

from __future__ import annotations

import pytest
import torch

from kdaserve.ops.gpu.mla_decode import mla_decode_split_k_triton, split_size
from kdaserve.ops.mla import mla_decode_split_k_torch

pytestmark = pytest.mark.gpu


def _case(T, H, N, R, DC, VD, bs, W, lens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)

    nb = T * W + 3
    pages = r(nb, bs, DC + R)
    # each row's pages in shuffled order across the pool
    perm = torch.randperm(nb, generator=gen)[: T * W].view(T, W).to(device)
    return dict(q_nope=r(T, H, N), q_pe=r(T, H, R), pages=pages, blocks=perm,
                kv_lens=torch.tensor(lens, device=device), w_uk=r(H, N, DC, s=0.5),
                w_uv=r(H, VD, DC, s=0.5), scale=(N + R) ** -0.5)


def _reference(c):
    f = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
         for k, v in c.items()}
    return mla_decode_split_k_torch(**f)


@pytest.mark.parametrize("T,H,N,R,DC,VD,bs,W,lens,dtype", [
    (5, 3, 8, 4, 12, 8, 4, 12, [0, 5, 47, 33, 16], torch.float32),   # 3 splits, ragged
    (3, 20, 8, 4, 24, 6, 8, 7, [56, 1, 40], torch.float32),           # 2 head groups
    (3, 4, 8, 0, 16, 8, 4, 9, [36, 17, 0], torch.float32),            # no rope part
    (4, 3, 8, 4, 12, 8, 4, 12, [9, 48, 0, 30], torch.bfloat16),
])
def test_matches_reference(T, H, N, R, DC, VD, bs, W, lens, dtype, device):
    c = _case(T, H, N, R, DC, VD, bs, W, lens, dtype, device)
    # the cases span several splits
    assert split_size(W * bs, 16)[1] > 1
    out = mla_decode_split_k_triton(**c, split_tokens=16)
    assert out.shape == (T, H, VD) and out.dtype == dtype
    ref = _reference(c)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for t, n in enumerate(lens):
        if n == 0:                                       # a padding row: exact zeros
            assert torch.equal(out[t], torch.zeros_like(out[t]))


def test_a_rows_result_does_not_depend_on_its_batch(device):
    """The split is a fixed number of keys (below MAX_SPLITS): a row alone and the same row
    beside a longer one (a wider block table, more splits) give the same bits."""
    c = _case(2, 3, 8, 4, 12, 8, 4, 12, [21, 48], torch.float32, device, seed=3)
    both = mla_decode_split_k_triton(**c, split_tokens=16)
    alone = dict(c, q_nope=c["q_nope"][:1], q_pe=c["q_pe"][:1], blocks=c["blocks"][:1, :6],
                 kv_lens=c["kv_lens"][:1])
    assert torch.equal(mla_decode_split_k_triton(**alone, split_tokens=16), both[:1])


def test_split_count_comes_from_shapes():
    assert split_size(24 * 16) == (256, 2)
    assert split_size(16) == (256, 1)
    # past SPLIT_TOKENS * MAX_SPLITS keys the split grows and the count stays bounded
    split, ns = split_size(1 << 20)
    assert ns <= 64 and split * ns >= 1 << 20 and split % 16 == 0


def test_launch_reads_nothing_back(device):
    """Graph-safe: no tensor value is read on the host (the grid comes from the block table's
    shape, the lengths are read in the kernels)."""
    from no_reads import no_reads

    c = _case(3, 3, 8, 4, 12, 8, 4, 12, [5, 0, 40], torch.float32, device, seed=4)
    with no_reads():
        out = mla_decode_split_k_triton(**c, split_tokens=16)
    torch.testing.assert_close(out, _reference(c), rtol=1e-5, atol=1e-5)
