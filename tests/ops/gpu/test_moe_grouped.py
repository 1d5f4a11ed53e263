"""The grouped Triton MoE (kdaserve/ops/gpu/moe_grouped.py) against the torch reference
backend (a loop over the experts), for plain fp32/bf16 experts and for Kimi K3's latent MXFP4
experts with SiTU; the routing corner cases (one expert takes every token, most take none);
SparseMoE's wiring; that the launcher reads nothing back; and (without CUDA) that the kernels
compile for the H200 (sm_90) with the real compiler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kdaserve.model.moe import SparseMoE
from kdaserve.model.moe_backends import reference
from kdaserve.model.registry import load_config
from kdaserve.ops.gpu import moe_grouped
from kdaserve.ops.gpu.moe_grouped import ExpertWeights, fused_moe
from kdaserve.ops.gpu.moe_tiles import slot_tiles, tile_bound

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from k3_models import k3_raw
from no_reads import no_reads
from tiny_models import tiny_config

pytestmark = pytest.mark.gpu

E, TOP_K = 8, 2


def _moe(kind: str, device: torch.device) -> SparseMoE:
    """"plain": Kimi Linear's (SiLU, x is the hidden state); "mxfp4": K3's latent experts
    (SiTU with both clips, W = routed_expert_hidden_size, packed E2M1 + E8M0 scales)."""
    g = torch.Generator().manual_seed(7)
    if kind == "plain":
        cfg = tiny_config(num_experts=E, num_experts_per_token=TOP_K, hidden_size=80,
                          moe_intermediate_size=48)
    else:
        cfg = load_config(k3_raw(mxfp4=True, moe_intermediate_size=64,
                                 routed_expert_hidden_size=96))
    moe = SparseMoE(cfg)
    with torch.no_grad():
        if moe.quantized:
            for name in ("experts_w13", "experts_w2"):
                p, s = getattr(moe, f"{name}_packed"), getattr(moe, f"{name}_scale")
                p.copy_(torch.randint(0, 256, p.shape, generator=g, dtype=torch.uint8))
                s.copy_(torch.randint(122, 127, s.shape, generator=g, dtype=torch.uint8))
        else:
            for p in (moe.experts_w13, moe.experts_w2):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe.to(device).eval()


def _routing(T: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(TOP_K, -1).indices
    weights = torch.rand(T, TOP_K, generator=g)
    return weights.to(device), ids.to(device)


def _run(moe: SparseMoE, x, weights, ids) -> torch.Tensor:
    if moe.quantized:
        w13 = ExpertWeights(moe.experts_w13_packed, moe.experts_w13_scale)
        w2 = ExpertWeights(moe.experts_w2_packed, moe.experts_w2_scale)
    else:
        w13, w2 = ExpertWeights(moe.experts_w13), ExpertWeights(moe.experts_w2)
    return fused_moe(x, weights, ids, w13, w2, moe.act)


# fp32 against fp32: the sums run in another order. bf16: both round the projections and the
# activation to bf16, at different points (the reference also every weighted row and the
# running sum), so the outputs differ by a few bf16 steps of the largest terms: the bound is
# relative to the output's scale
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    else:
        err = (got.float() - want.float()).abs().max()
        assert err <= 3e-2 * want.float().abs().max(), (err, want.float().abs().max())


@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("kind,dtype", [("plain", torch.float32), ("plain", torch.bfloat16),
                                        ("mxfp4", torch.float32), ("mxfp4", torch.bfloat16)])
def test_grouped_kernel_matches_the_reference(device, kind, dtype, T):
    moe = _moe(kind, device)
    if not moe.quantized:
        moe.to(dtype)
    x = torch.randn(T, moe.width, generator=torch.Generator().manual_seed(T)).to(device, dtype)
    weights, ids = _routing(T, T + 1, device)
    with torch.inference_mode():
        want = reference(moe, x, weights, ids)
        got = _run(moe, x, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    assert want.abs().max() > 0.1            # the experts do something
    _close(got, want)


@pytest.mark.parametrize("kind", ["plain", "mxfp4"])
def test_one_expert_takes_every_token_and_most_take_none(device, kind):
    """33 tokens: every one picks expert 5 first, then 2 or 7; experts 0, 1, 3, 4, 6 idle."""
    moe = _moe(kind, device)
    T = 33
    x = torch.randn(T, moe.width, generator=torch.Generator().manual_seed(1)).to(device)
    second = torch.where(torch.arange(T) % 3 == 0, 2, 7)
    ids = torch.stack([torch.full((T,), 5), second], 1).to(device)
    weights = torch.rand(T, TOP_K, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode():
        want = reference(moe, x, weights, ids)
        got = _run(moe, x, weights, ids)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_the_tile_table_covers_every_slot_once(device):
    """Tiles past the real ones are marked empty; the real ones hold one expert's slots each
    and together every slot exactly once, within the bound the grid is launched with."""
    T, block_m = 40, 16
    ids = torch.stack([torch.full((T,), 3), torch.arange(T) % 4], 1)
    ids[:, 1][ids[:, 1] == 3] = 6
    tiles = slot_tiles(ids.to(device), E, block_m)
    assert tiles.count == tile_bound(T * 2, E, block_m)
    flat = ids.reshape(-1)
    covered = []
    for e, s, t in zip(tiles.expert.tolist(), tiles.start.tolist(), tiles.end.tolist()):
        if e < 0:
            continue
        assert 0 < t - s <= block_m
        slots = tiles.order[s:t].cpu()
        assert (flat[slots.long()] == e).all()
        covered += slots.tolist()
    assert sorted(covered) == list(range(T * 2))
    per_expert = torch.bincount(flat, minlength=E)
    assert (tiles.expert >= 0).sum() == sum(-(-int(c) // block_m) for c in per_expert)


def test_sparse_moe_runs_the_kernel_sync_free(device, monkeypatch):
    """SparseMoE's routed sum goes through the kernel where it applies (prefill and decode,
    sync_free or not), reads nothing back, and equals the reference backend."""
    calls = []
    real = moe_grouped.fused_moe
    monkeypatch.setattr(moe_grouped, "fused_moe",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    moe = _moe("mxfp4", device)
    x = torch.randn(3, moe.gate.weight.shape[1],
                    generator=torch.Generator().manual_seed(4)).to(device)
    with torch.inference_mode():
        with no_reads():
            got = moe(x, sync_free=True)
        assert calls
        moe.routed_backend = reference
        want = moe(x)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


# (kernel, pointer/float types, constexprs): each weight form, dtype and tile height
_BF16_PLAIN = {"w_ptr": "*bf16", "s_ptr": "*bf16"}
_MX = {"w_ptr": "*u8", "s_ptr": "*u8"}
_TILE_PTRS = {"order_ptr": "*i32", "t_exp_ptr": "*i32", "t_start_ptr": "*i32",
              "t_end_ptr": "*i32"}
_COMPILES = [
    ("_gate_up_kernel", {"x_ptr": "*bf16", "h_ptr": "*bf16", **_BF16_PLAIN},
     {"MXFP4": False, "SITU": False, "CLIP_UP": False, "PRECISION": "tf32", "BLOCK_M": 16}),
    ("_gate_up_kernel", {"x_ptr": "*bf16", "h_ptr": "*bf16", **_MX},
     {"MXFP4": True, "SITU": True, "CLIP_UP": True, "PRECISION": "tf32", "BLOCK_M": 64}),
    ("_gate_up_kernel", {"x_ptr": "*fp32", "h_ptr": "*fp32", "w_ptr": "*fp32",
                         "s_ptr": "*fp32"},
     {"MXFP4": False, "SITU": False, "CLIP_UP": False, "PRECISION": "ieee", "BLOCK_M": 16}),
    ("_down_kernel", {"h_ptr": "*bf16", "y_ptr": "*bf16", **_BF16_PLAIN},
     {"MXFP4": False, "PRECISION": "tf32", "BLOCK_M": 64}),
    ("_down_kernel", {"h_ptr": "*bf16", "y_ptr": "*bf16", **_MX},
     {"MXFP4": True, "PRECISION": "tf32", "BLOCK_M": 16}),
]

_COMPILE_SCRIPT = """
import json, sys
from triton_aot import compile_for
from kdaserve.ops.gpu import moe_grouped as m
for name, types, consts in json.loads(sys.argv[1]):
    types = {**TILE, "y_ptr": "*fp32", "rw_ptr": "*fp32", "beta": "fp32",
             "linear_beta": "fp32", **types}
    consts = {"UPCAST": False, "BLOCK_N": 64, "BLOCK_K": 64, **consts}
    kernel = getattr(m, name)
    types = {k: v for k, v in types.items() if k in kernel.arg_names}
    assert len(compile_for(kernel, types, consts).asm["cubin"]) > 0
print("compiled", len(json.loads(sys.argv[1])))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real")
def test_kernels_compile_for_the_h200():
    """Triton's compiler down to an sm_90 cubin (ptxas included), outside the interpreter.
    Triton's own cache (~/.triton/cache, as compile_sm90.py's) keeps a cubin by a hash of the
    kernel's source, the functions it calls, the options and Triton's version: a kernel
    compiled before and unchanged since is not compiled again (~6 s of CPU)."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""),
                                           str(root), str(root / "tests")]))
    script = _COMPILE_SCRIPT.replace("TILE", repr(_TILE_PTRS))
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(_COMPILES)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"compiled {len(_COMPILES)}" in proc.stdout
