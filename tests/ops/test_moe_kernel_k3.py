"""The compiled MoE expert kernels for Kimi K3: the activation selector (SiLU / SiTU) of the
fp32 ragged-group kernel, and the MXFP4 kernel that reads the checkpoint's packed experts;
both against a per-expert torch reference, plus the token-range and group-mate contracts and
a check that the MXFP4 kernel reads the weights it is given."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import require

from kdaserve.ops import cpu_kernels, moe_kernel
from kdaserve.ops.activation import GLUActivation
from kdaserve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4

E, H, I, TOP_K = 8, 64, 96, 2
ACTS = {
    "silu": GLUActivation(),
    "situ": GLUActivation("situ", beta=1.5),
    "situ_lb": GLUActivation("situ", beta=1.5, linear_beta=2.0),
}


def _fp32_kernel():
    return require(moe_kernel.moe_experts_kernel(), "csrc/moe_cpu.c (fp32)")


def _mxfp4_kernel():
    return require(moe_kernel.moe_experts_mxfp4_kernel(), "csrc/moe_cpu.c (MXFP4)")


def _routing(T: int, seed: int, num_experts: int = E, k: int = TOP_K):
    """Top-k routing from random ids, as SparseMoE builds it: token [S] grouped by expert
    (ascending within a group), offsets [E+1], slot weights [S], and the raw ids/weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, num_experts, generator=g).topk(k, -1).indices           # [T,k]
    weights = torch.rand(T, k, generator=g)
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    slot_w = weights.reshape(-1)[order].contiguous()
    offsets = torch.zeros(num_experts + 1, dtype=torch.long)
    offsets[1:] = torch.bincount(flat, minlength=num_experts).cumsum(0)
    return token, offsets, slot_w, ids, weights


def _reference(x, ids, weights, w1, w3, w2, act):
    """Per expert: act(x@w1.T, x@w3.T) @ w2.T, weighted, index_add (w1, w3 [E,I,H],
    w2 [E,H,I])."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        xe = x[t]
        y = act(xe @ w1[e].T, xe @ w3[e].T) @ w2[e].T
        out.index_add_(0, t, y * weights[t, j, None])
    return out


def _close(got, want):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def _fp32_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    # pre-activations of a few units, so SiTU's tanh clips are exercised on both sides
    w1 = torch.randn(E, I, H, generator=g) * 0.4
    w3 = torch.randn(E, I, H, generator=g) * 0.4
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    return w1, w3, w2


@pytest.mark.parametrize("act_name", list(ACTS))
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_fp32_kernel_activations_match_torch(T, act_name):
    kernel = _fp32_kernel()
    act = ACTS[act_name]
    w1, w3, w2 = _fp32_weights(T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T + 1))
    token, offsets, slot_w, ids, weights = _routing(T, seed=T + 2)
    w13t = torch.cat([w1, w3], 1).transpose(1, 2).contiguous()                # [E,H,2I]
    w2t = w2.transpose(1, 2).contiguous()                                       # [E,I,H]
    got = kernel(x, token, offsets, slot_w, w13t, w2t, torch.zeros(T, H), act=act)
    _close(got, _reference(x, ids, weights, w1, w3, w2, act))
    if act_name == "silu":   # the default is SiLU, bitwise
        default = kernel(x, token, offsets, slot_w, w13t, w2t, torch.zeros(T, H))
        assert torch.equal(default, got)


def _mxfp4_weights(seed: int):
    """Random experts quantized to MXFP4, with scales spread over 2^-8..2^5 and some scale
    bytes 0 (the subnormal 2^-127: those groups are ~0)."""
    g = torch.Generator().manual_seed(seed)

    def make(rows: int, k: int, std: float):
        w = torch.randn(E, rows, k, generator=g) * std
        spread = 2.0 ** torch.randint(-4, 4, (E, rows, k // 32, 1), generator=g).float()
        packed, scale = quantize_mxfp4((w.view(E, rows, k // 32, 32) * spread).view(E, rows, k))
        zero = torch.rand(scale.shape, generator=g) < 0.05
        scale[zero] = 0
        return packed, scale

    w13_packed, w13_scale = make(2 * I, H, 0.2)
    w2_packed, w2_scale = make(H, I, 0.05)
    assert (w13_scale == 0).any() and (w2_scale == 0).any()
    assert int(w13_scale.max()) - int(w13_scale[w13_scale > 0].min()) >= 6
    return w13_packed, w13_scale, w2_packed, w2_scale


def _dequantized(w13_packed, w13_scale, w2_packed, w2_scale):
    w13 = dequantize_mxfp4(w13_packed, w13_scale)                               # [E,2I,H]
    w2 = dequantize_mxfp4(w2_packed, w2_scale)                                  # [E,H,I]
    return w13[:, :I], w13[:, I:], w2


@pytest.mark.parametrize("act_name", list(ACTS))
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_mxfp4_kernel_matches_dequantized_torch(T, act_name):
    kernel = _mxfp4_kernel()
    act = ACTS[act_name]
    weights_q = _mxfp4_weights(T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T + 1))
    token, offsets, slot_w, ids, weights = _routing(T, seed=T + 2)
    got = kernel(x, token, offsets, slot_w, *weights_q, torch.zeros(T, H), act=act)
    want = _reference(x, ids, weights, *_dequantized(*weights_q), act)
    assert want.abs().max() > 0
    _close(got, want)


def test_mxfp4_kernel_matches_fp32_kernel_on_the_same_weights():
    """Both kernels on one set of (dequantized) weights agree to rounding."""
    fp32, mx = _fp32_kernel(), _mxfp4_kernel()
    T = 40
    weights_q = _mxfp4_weights(5)
    w1, w3, w2 = _dequantized(*weights_q)
    x = torch.randn(T, H)
    token, offsets, slot_w, _, _ = _routing(T, seed=6)
    w13t = torch.cat([w1, w3], 1).transpose(1, 2).contiguous()
    a = fp32(x, token, offsets, slot_w, w13t, w2.transpose(1, 2).contiguous(),
             torch.zeros(T, H), act=ACTS["situ_lb"])
    b = mx(x, token, offsets, slot_w, *weights_q, torch.zeros(T, H), act=ACTS["situ_lb"])
    _close(b, a)


def _raw(name: str):
    """The C function with its argument types bound here (another test may have cleared the
    library cache after the kernel factories bound theirs)."""
    assert (_fp32_kernel() if name == "moe_experts_act" else _mxfp4_kernel()) is not None
    i64, ptr, f32 = cpu_kernels._I64, cpu_kernels._PTR, cpu_kernels._F32
    n_ptrs = 7 if name == "moe_experts_act" else 9
    return cpu_kernels._c_function("moe_cpu.c", name,
                                   [i64] * 5 + [ptr] * n_ptrs + [i64, f32, f32])


def _ptrs(*ts):
    return [cpu_kernels._ptr(t) for t in ts]


@pytest.mark.parametrize("name", ["moe_experts_act", "moe_experts_mxfp4"])
def test_token_ranges_are_bitwise_independent(name):
    """[0,T) in one call equals [0,m) then [m,T) bitwise, for both kernels and SiTU."""
    fn = _raw(name)
    T = 37
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    token, offsets, slot_w, _, _ = _routing(T, seed=4)
    if name == "moe_experts_act":
        w1, w3, w2 = _fp32_weights(5)
        weights = (torch.cat([w1, w3], 1).transpose(1, 2).contiguous(),
                   w2.transpose(1, 2).contiguous())
    else:
        weights = _mxfp4_weights(5)
    args = _ptrs(x, token, offsets, slot_w, *weights)
    act = (1, 1.5, 2.0)
    whole, halves = torch.zeros(T, H), torch.zeros(T, H)
    fn(0, T, E, H, I, *args, *_ptrs(whole), *act)
    for lo, hi in ((0, 13), (13, T)):
        fn(lo, hi, E, H, I, *args, *_ptrs(halves), *act)
    assert torch.equal(whole, halves) and whole.abs().sum() > 0


@pytest.mark.parametrize("act_name", ["silu", "situ_lb"])
def test_mxfp4_token_result_does_not_depend_on_group_mates(act_name):
    """A token alone gives bitwise its result in a batch (groups of 1 vs up to 8+ rows)."""
    kernel = _mxfp4_kernel()
    T = 50
    weights_q = _mxfp4_weights(7)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(8))
    token, offsets, slot_w, ids, weights = _routing(T, seed=9)
    batch = kernel(x, token, offsets, slot_w, *weights_q, torch.zeros(T, H), act=ACTS[act_name])
    for t in (0, 17, T - 1):
        order = ids[t].argsort(stable=True)
        e_sorted = ids[t][order]
        offs = torch.zeros(E + 1, dtype=torch.long)
        offs[1:] = torch.bincount(e_sorted, minlength=E).cumsum(0)
        alone = kernel(x[t:t + 1], torch.zeros(TOP_K, dtype=torch.long), offs,
                       weights[t][order].contiguous(), *weights_q, torch.zeros(1, H),
                       act=ACTS[act_name])
        assert torch.equal(alone[0], batch[t]), t


def test_mxfp4_kernel_reads_the_weights():
    """Corrupting one packed byte (or scale) of an expert with rows changes the output;
    corrupting an expert without rows changes nothing."""
    kernel = _mxfp4_kernel()
    T = 3
    weights_q = _mxfp4_weights(11)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(12))
    token, offsets, slot_w, ids, _ = _routing(T, seed=13)
    base = kernel(x, token, offsets, slot_w, *weights_q, torch.zeros(T, H))
    used = sorted(set(ids.reshape(-1).tolist()))
    unused = [e for e in range(E) if e not in used]
    e = used[0]

    def run_with(i: int, index: tuple, value: int) -> torch.Tensor:
        w = [t.clone() for t in weights_q]
        w[i][index] = value
        return kernel(x, token, offsets, slot_w, *w, torch.zeros(T, H))

    w13_scale, w2_scale = weights_q[1], weights_q[3]
    # a gate byte in a group with a normal scale, flipped in sign and magnitude
    row = int((w13_scale[e, :I, 0] > 100).nonzero()[0])
    byte = int(weights_q[0][e, row, 0])
    assert not torch.equal(run_with(0, (e, row, 0), byte ^ 0x99), base)
    assert not torch.equal(run_with(1, (e, row, 0), int(w13_scale[e, row, 0]) + 3), base)
    row = int((w2_scale[e, :, 0] > 100).nonzero()[0])
    byte = int(weights_q[2][e, row, 0])
    assert not torch.equal(run_with(2, (e, row, 0), byte ^ 0x99), base)
    assert unused, "3 tokens x top-2 of 8 leave an expert idle"
    assert torch.equal(run_with(0, (unused[0], 0, 0), 0x77), base)
    assert torch.equal(run_with(3, (unused[0], 0, 0), 200), base)


def test_mxfp4_kernel_rejects_sizes_off_the_scale_groups():
    kernel = _mxfp4_kernel()
    Ib = 40
    packed, scale = torch.zeros(1, 2 * Ib, H // 2, dtype=torch.uint8), torch.zeros(
        1, 2 * Ib, H // 32, dtype=torch.uint8)
    w2p, w2s = torch.zeros(1, H, Ib // 2, dtype=torch.uint8), torch.zeros(1, H, 1,
                                                                           dtype=torch.uint8)
    with pytest.raises(AssertionError, match="multiples of 32"):
        kernel(torch.zeros(1, H), torch.zeros(1, dtype=torch.long),
               torch.tensor([0, 1]), torch.ones(1), packed, scale, w2p, w2s, torch.zeros(1, H))


def test_disabled_kernels_are_none(monkeypatch):
    caches = (cpu_kernels._library, moe_kernel.moe_experts_kernel,
              moe_kernel.moe_experts_mxfp4_kernel)
    monkeypatch.setenv("KDASERVE_CPU_KERNELS", "0")
    for c in caches:
        c.cache_clear()
    try:
        assert moe_kernel.moe_experts_kernel() is None
        assert moe_kernel.moe_experts_mxfp4_kernel() is None
    finally:
        monkeypatch.delenv("KDASERVE_CPU_KERNELS")
        for c in caches:
            c.cache_clear()
