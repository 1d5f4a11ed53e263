"""The Triton KDA decode kernel against the torch reference `kda_recurrent_slots`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdaserve.ops.gpu.kda_decode import kda_recurrent_slots_triton
from kdaserve.ops.kda import kda_recurrent_slots

pytestmark = pytest.mark.gpu


def _inputs(B, L, H, K, V, S, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(r(B, L, H, K), dim=-1) * K ** -0.5
    k = F.normalize(r(B, L, H, K), dim=-1)
    v = r(B, L, H, V)
    g = -F.softplus(r(B, L, H, K)) * 0.5
    beta = torch.sigmoid(r(B, L, H))
    store = r(S, H, K, V) * 0.3
    xs = [x.to(dtype).to(device) for x in (q, k, v, g, beta)]
    return store.to(device), xs


@pytest.mark.parametrize("B,L,H,K,V,dtype,keep", [
    (3, 1, 2, 16, 16, torch.float32, False),
    (4, 3, 3, 24, 20, torch.float32, True),     # K, V not powers of two: masked
    (2, 3, 2, 12, 40, torch.bfloat16, True),    # two V tiles, the second partial
    (3, 1, 1, 8, 8, torch.bfloat16, False),
])
def test_matches_reference_on_permuted_slots(B, L, H, K, V, dtype, keep, device):
    S = B + 3
    store, (q, k, v, g, beta) = _inputs(B, L, H, K, V, S, dtype, device, seed=B * 7 + L)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(S, generator=gen)[:B].to(device)
    ref_store = store.clone()
    # the reference computes in fp32 from the same (rounded) inputs
    o_ref, kept_ref = kda_recurrent_slots(ref_store, slots, q.float(), k.float(), v.float(),
                                          g.float(), beta.float(), keep_states=keep)
    before = store.clone()
    o, kept = kda_recurrent_slots_triton(store, slots, q, k, v, g, beta, keep_states=keep)
    assert o.shape == (B, L, H, V) and o.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(store, ref_store, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(store[untouched.to(device)], before[untouched.to(device)])
    assert not torch.equal(store[slots], before[slots])
    if keep:
        assert kept is not None and kept.shape == (B, L, H, K, V)
        torch.testing.assert_close(kept, kept_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(kept[:, -1], store[slots])
    else:
        assert kept is None


def test_padding_rows_are_skipped(device):
    """A negative slot (a padded graph batch's filler row) touches no state, gives zeros, and
    leaves the other rows' results as they are without it."""
    B, L, H, K, V, S = 4, 3, 2, 16, 12, 6
    store, (q, k, v, g, beta) = _inputs(B, L, H, K, V, S, torch.float32, device, seed=5)
    q[2] = float("nan")              # whatever a padding row holds must not leak
    slots = torch.tensor([4, 0, -1, 2], device=device)
    live = torch.tensor([0, 1, 3], device=device)
    ref_store = store.clone()
    o_ref, kept_ref = kda_recurrent_slots(ref_store, slots[live], q[live], k[live], v[live],
                                          g[live], beta[live], keep_states=True)
    before = store.clone()
    o, kept = kda_recurrent_slots_triton(store, slots, q, k, v, g, beta, keep_states=True)
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    assert torch.equal(kept[2], torch.zeros_like(kept[2]))
    torch.testing.assert_close(o[live], o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept[live], kept_ref, rtol=1e-5, atol=1e-6)
    for s in (1, 3, 5):
        assert torch.equal(store[s], before[s])
    torch.testing.assert_close(store, ref_store, rtol=1e-5, atol=1e-6)


def test_strided_inputs_and_int32_slots(device):
    """The model hands q, k, v as views of one [T,3,H,D] tensor, and slots may be int32."""
    B, H, D, S = 3, 2, 16, 5
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, 1, 3, H, D, generator=gen).to(device)
    q, k, v = (F.normalize(x, dim=-1) for x in qkv.unbind(2))
    g = (-torch.rand(B, 1, H, D, generator=gen)).to(device)
    beta = torch.rand(B, 1, H, generator=gen).to(device)
    store = torch.randn(S, H, D, D, generator=gen).to(device)
    slots = torch.tensor([3, 1, 4], dtype=torch.int32, device=device)
    ref_store = store.clone()
    o_ref, _ = kda_recurrent_slots(ref_store, slots.long(), q, k, v, g, beta)
    o, _ = kda_recurrent_slots_triton(store, slots, q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(store, ref_store, rtol=1e-5, atol=1e-6)


def test_launch_reads_nothing_back(device):
    """Graph-safe: the wrapper and launch read no tensor value on the host (the slots, padding
    included, are read in the kernel)."""
    from no_reads import no_reads

    B, L, H, K, V, S = 3, 2, 2, 8, 8, 5
    store, (q, k, v, g, beta) = _inputs(B, L, H, K, V, S, torch.float32, device, seed=9)
    slots = torch.tensor([3, -1, 0], device=device)
    ref_store = store.clone()
    want, _ = kda_recurrent_slots(ref_store, slots[[0, 2]], q[[0, 2]], k[[0, 2]], v[[0, 2]],
                                  g[[0, 2]], beta[[0, 2]])
    with no_reads():
        o, _ = kda_recurrent_slots_triton(store, slots, q, k, v, g, beta, keep_states=True)
    torch.testing.assert_close(o[[0, 2]], want, rtol=1e-5, atol=1e-6)
