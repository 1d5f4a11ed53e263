"""The compiled CPU kernels built for aarch64 (NEON; SVE at 256 and 512 bits) and run under
qemu-user, against the torch oracle: the kernel tests of the x86 build, run with every compiled
kernel the Python side loads routed to the aarch64 build (tests/ops/remote_kernels.py), with
their references and tolerances; the fused decode blocks against the model's torch forward;
and, where the kernels promise it (the same sums in the same order, no contraction: ISO C),
bit-identical results to this machine's own build on the same inputs.

Needs `aarch64-linux-gnu-gcc` and `qemu-aarch64` (Debian: gcc-aarch64-linux-gnu, qemu-user);
skips without them. Speed under emulation means nothing: nothing here is timed."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cross_build as cb
import pytest
import remote_kernels as rk
import test_cpu_kernels
import test_cpu_linear
import test_moe_kernel_k3
import test_sample_kernel
import torch

from kdaserve.ops import mla

pytestmark = pytest.mark.skipif(cb.missing_tools() is not None,
                                reason=cb.missing_tools() or "")

TARGETS = {t.name: t for t in cb.aarch64_targets()}
# the whole set on NEON; on the SVE builds (the same C, other code generation) the kernels
# once each and the bitwise comparison, to keep the emulated time short
NEON = pytest.mark.parametrize("runner", ["neon"], indirect=True)


@pytest.fixture(scope="module", params=list(TARGETS))
def runner(request):
    r = rk.Runner(TARGETS[request.param], cb.build(TARGETS[request.param]))
    yield r
    r.close()


@pytest.fixture(scope="module")
def host():
    r = rk.Runner(cb.host_target(), cb.host_build())
    yield r
    r.close()


def _model_tests():
    """tests/model/test_fused_decode.py (the fused blocks' references), imported once."""
    name = "test_fused_decode"
    if name not in sys.modules:
        path = Path(__file__).parents[1] / "model" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def on_target(runner):
    with rk.routed_to(runner):
        yield runner


def test_the_calls_run_in_the_target_build(runner):
    """What every test here relies on: within routed_to the wrappers get the target's
    functions, aarch64 code under qemu (SVE code in the SVE builds), and a call that cannot
    be made fails loudly."""
    from kdaserve.ops import cpu_kernels

    for path in runner.built.values():
        assert path.read_bytes()[18] == 0xB7, path            # ELF e_machine: EM_AARCH64
    assert runner.target.runner[0].endswith(("qemu-aarch64", "qemu-aarch64-static"))
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        text = subprocess.run([objdump, "-d", str(runner.built["decode_cpu.c"])], check=True,
                              capture_output=True, text=True).stdout
        sve = re.search(r"\s(whilelo|ptrue)\s", text) is not None
        assert sve == runner.target.name.startswith("sve")
    local = cpu_kernels._c_function
    with rk.routed_to(runner):
        fn = cpu_kernels._c_function("kda_cpu.c", "kda_recurrent_slots", [])
        assert isinstance(fn, rk.RemoteFunction) and fn.runner is runner
        with pytest.raises(RuntimeError, match="no such symbol"):
            cpu_kernels._c_function("kda_cpu.c", "no_such_kernel", [])()
    assert cpu_kernels._c_function is local                              # restored


@pytest.mark.parametrize("B,L,H,D", [(1, 1, 1, 4), (5, 1, 2, 8), (3, 6, 2, 16), (4, 1, 2, 64),
                                     (2, 3, 2, 64), (2, 2, 1, 128)])
def test_kda_recurrence(on_target, B, L, H, D):
    test_cpu_kernels.test_compiled_matches_reference(B, L, H, D)


@NEON
def test_kda_rows_independent_of_batch_and_threads(on_target):
    test_cpu_kernels.test_compiled_rows_are_independent_of_batch()
    test_cpu_kernels.test_thread_count_does_not_change_results()


@pytest.mark.parametrize("rows,out,inner", [(1, 900, 256), (5, 33, 64), (7, 16, 5),
                                            (150, 96, 256), (301, 40, 17)])
def test_row_products(on_target, rows, out, inner):
    test_cpu_linear.test_matches_f_linear(rows, out, inner)


@NEON
def test_row_products_independent_of_batch(on_target):
    for rows in (4, 200):
        test_cpu_linear.test_rows_do_not_depend_on_their_batch(rows)


@pytest.mark.parametrize("runner,T", [("neon", 1), ("neon", 64), *((t, 3) for t in TARGETS)],
                         indirect=["runner"])
def test_moe_experts(on_target, T):
    test_cpu_kernels.test_moe_kernel_matches_torch_experts(T)
    for act in test_moe_kernel_k3.ACTS:
        test_moe_kernel_k3.test_fp32_kernel_activations_match_torch(T, act)
        test_moe_kernel_k3.test_mxfp4_kernel_matches_dequantized_torch(T, act)


@NEON
def test_moe_contracts(on_target):
    test_cpu_kernels.test_moe_kernel_token_ranges_are_bitwise_independent()
    test_moe_kernel_k3.test_mxfp4_kernel_matches_fp32_kernel_on_the_same_weights()
    for name in ("moe_experts_act", "moe_experts_mxfp4"):
        test_moe_kernel_k3.test_token_ranges_are_bitwise_independent(name)
    for act in ("silu", "situ_lb"):
        test_moe_kernel_k3.test_mxfp4_token_result_does_not_depend_on_group_mates(act)


@pytest.mark.parametrize("tiles", ["one", "many"])
def test_mla_paged_decode(on_target, monkeypatch, tiles):
    import test_mla_blockwise as t

    if tiles == "many":
        for name, value in (("PREFILL_TILE_BYTES", 1), ("DECODE_TILE_BYTES", 1),
                            ("DECODE_SPLIT_TOKENS", 2 * t.BS),
                            ("DECODE_KERNEL_SPLIT_TOKENS", 2 * t.BS)):
            monkeypatch.setattr(mla, name, value)
    assert mla._paged_decode_kernel() is not None

    class Tiles:         # the `request` the test asks its small_tiles fixture of: set above
        def getfixturevalue(self, name: str) -> None:
            assert name == "small_tiles"

    t.test_split_k_decode_equals_absorbed_reference("torch", tiles, "kernel", Tiles(),
                                                    monkeypatch)


@NEON
def test_sampling(on_target):
    test_sample_kernel.test_top_k_one_and_ties_keep_the_first_best()
    for V, scale in ((100, 2.0), (4096, 12.0)):
        test_sample_kernel.test_compiled_matches_the_torch_form(V, scale)


@pytest.mark.parametrize("runner,gate,rows", [
    ("neon", "full_rank", 1), ("neon", "no_shared", 3), *((t, "low_rank", 3) for t in TARGETS)],
    indirect=["runner"])
def test_fused_decode_blocks(on_target, gate, rows):
    _model_tests().test_step_matches_torch_forward(gate, rows)


@NEON
@pytest.mark.parametrize("experts", ["transposed", "checkpoint"])   # matmat_t / matmat
def test_fused_decode_blocks_bf16(on_target, experts):
    _model_tests().test_bf16_step_matches_fp32_forward_of_the_rounded_weights(
        "low_rank", experts)


# ---- the same bits as this machine's build --------------------------------------------------
# Each case computes on fixed inputs through the Python wrappers and returns what the kernels
# wrote; run once routed to the host's build and once to the target's, the two must be equal.

def _linear() -> list[torch.Tensor]:
    from kdaserve.ops.cpu_linear import k_major_weight, linear

    g = torch.Generator().manual_seed(0)
    w = k_major_weight(torch.randn(200, 72, generator=g))      # wide, 6-row and 16-col tiles
    return [linear(torch.randn(rows, 72, generator=g), w) for rows in (1, 2, 7, 13)]


def _kda() -> list[torch.Tensor]:
    from kdaserve.ops import cpu_kernels

    out = []
    for B, L, H, D in ((2, 3, 2, 64), (1, 2, 1, 128), (3, 2, 2, 16)):
        q, k, v, gate, beta = test_cpu_kernels._inputs(B, L, H, D, seed=D)
        store = torch.randn(B + 1, H, D, D, generator=torch.Generator().manual_seed(1)) * 0.1
        kept = torch.empty(B, L, H, D, D)
        o = cpu_kernels.kda_recurrent_slots_kernel()(store, torch.arange(1, B + 1), q, k, v,
                                                      gate, beta, kept)
        out += [o, store, kept]
    g = torch.Generator().manual_seed(2)
    H, D, W, T = 2, 16, 3, 9
    pre, fraw = torch.randn(T, 3 * H * D, generator=g), torch.randn(T, H * D, generator=g)
    prepared = cpu_kernels.kda_prepare_kernel()(
        pre, torch.randn(2, W, 3 * H * D, generator=g), torch.tensor([0, 4, T]),
        torch.randn(W + 1, 3 * H * D, generator=g), fraw, torch.randn(H * D, generator=g),
        torch.rand(H, generator=g), torch.randn(T, H, generator=g), H, D ** -0.5)
    return out + list(prepared)


def _moe() -> list[torch.Tensor]:
    from kdaserve.ops.mxfp4 import quantize_mxfp4

    t = test_moe_kernel_k3
    token, offsets, slot_w, _, _ = t._routing(5, seed=3)
    x = torch.randn(5, t.H, generator=torch.Generator().manual_seed(4))
    w1, w3, w2 = t._fp32_weights(5)
    act = t.ACTS["situ_lb"]
    fp32 = cpu_kernels_fn("moe_experts_kernel")(
        x, token, offsets, slot_w, torch.cat([w1, w3], 1).transpose(1, 2).contiguous(),
        w2.transpose(1, 2).contiguous(), torch.zeros_like(x), act)
    (q13, s13), (q2, s2) = quantize_mxfp4(torch.cat([w1, w3], 1)), quantize_mxfp4(w2)
    mx = cpu_kernels_fn("moe_experts_mxfp4_kernel")(x, token, offsets, slot_w, q13, s13, q2,
                                                     s2, torch.zeros_like(x), act)
    return [fp32, mx]


def cpu_kernels_fn(name: str):
    from kdaserve.ops import cpu_kernels

    return getattr(cpu_kernels, name)()


def _mla() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    pages = torch.randn(12, 16, 40, generator=g)
    blocks = torch.randperm(12, generator=g)[:9].reshape(3, 3)
    qa = torch.randn(3, 4, 40, generator=g) * 0.2
    return [mla._paged_decode_kernel()(pages, blocks, torch.tensor([1, 29, 48]), qa)]


def _sample() -> list[torch.Tensor]:
    from kdaserve.ops.sample_kernel import sample_rows_kernel

    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(7)) * 3
    return [sample_rows_kernel()(logits.clone(), [0.0, 0.7, 1.0, 0.9, 1.2, 0.5],
                                 [500, 20, 500, 500, 3, 50], [1.0, 0.9, 1.0, 0.95, 1.0, 0.5],
                                 [0.0, 0.0, 0.05, 0.0, 0.0, 0.01],
                                 [0.1, 0.5, 0.9, 0.3, 0.7, 0.2], [(1.3, 0.4, 0.2)] * 6,
                                 [([1, 2, 3], [4, 5, 5])] * 6)]


def _fused() -> list[torch.Tensor]:
    """Three decode steps of three rows through the fused blocks of a tiny model (fp32
    weights, experts transposed; bf16, experts as the checkpoint lays them out): logits and
    every cache tensor."""
    from fused_cases import prefill
    from tiny_models import random_model, tiny_config
    from torch import nn

    from kdaserve.model.fused_decode import fused_decoder
    from kdaserve.model.hybrid_cache import HybridCache
    from kdaserve.model.moe import SparseMoE

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        cfg = tiny_config()
        model = random_model(cfg, seed=3).fuse_for_inference()
        cache = HybridCache.allocate(cfg, 64, 4, 8, num_snapshots=4)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 14)]
        tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)]
        prefill(model, cache, tables, [2, 3, 4], prompts)
        if dtype == torch.bfloat16:        # and the experts in the checkpoint's layout
            model = model.to_dtype(dtype)
            for layer in model.model.layers:
                if isinstance(layer.ffn, SparseMoE):
                    for name in ("experts_w13", "experts_w2"):
                        w = getattr(layer.ffn, name).detach().contiguous()
                        setattr(layer.ffn, name, nn.Parameter(w, requires_grad=False))
            for name in ("mla_pages", "kda_conv", "snap_conv"):
                setattr(cache, name, [t.to(dtype) for t in getattr(cache, name)])
        fused = fused_decoder(model, cache)
        assert fused.wdtype == dtype
        for step in range(3):
            ids = torch.randint(0, cfg.vocab_size, (3,), generator=g)
            ctx = [len(p) + step for p in prompts]
            out.append(fused(ids, torch.tensor(ctx), torch.tensor([2, 3, 4]),
                             torch.tensor(tables), cache))
        out += [t.float() for t in cache.kda_states + cache.kda_conv + cache.mla_pages]
    return out


CASES = {"row_products": _linear, "kda": _kda, "moe": _moe, "mla_paged": _mla,
         "sampling": _sample, "fused_decode": _fused}


@pytest.mark.parametrize("case", list(CASES))
def test_same_bits_as_the_host_build(runner, host, case):
    """Every output bit for bit as this machine's build computes it. The kernels sum in a
    fixed order and the build is ISO C (no contraction into fused multiply-adds, except the
    MXFP4 dot products, which fuse on both: moe_cpu.c v8fma), so only libm may differ: glibc's
    expf/logf (the MoE router's sigmoid, the attention-residual softmax, the paged decode's
    log-sum-exp) are the same algorithms on both and agree on these inputs, but nothing in
    the kernels promises it."""
    with rk.routed_to(host):
        want = CASES[case]()
    with rk.routed_to(runner):
        got = CASES[case]()
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        same = a.view(torch.int32) == b.view(torch.int32) if a.dtype == torch.float32 else a == b
        assert bool(same.all()), (case, i, int((~same).sum()), (a.float() - b.float()).abs().max())
