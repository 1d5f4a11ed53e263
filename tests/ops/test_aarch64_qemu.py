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

import aarch64_cases
import cross_build as cb
import pytest
import remote_kernels as rk
import test_cpu_int_linear
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
    for case in test_cpu_linear.BATCH_CASES:
        test_cpu_linear.test_rows_do_not_depend_on_their_batch(*case)


@NEON
def test_integer_dots(on_target):
    """The NEON build's integer dots (csrc/int_dot.h without the dot-product extension)
    against their oracle, bit for bit, and rows independent of their batch."""
    for bits in (8, 4):
        for shape in test_cpu_int_linear.INT_DOT_SHAPES[:4]:
            test_cpu_int_linear.test_integer_dots_are_their_oracle(bits, *shape, rows=2)


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
        test_sample_kernel.test_compiled_distributions_match_the_torch_form(V, scale)


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

@pytest.mark.parametrize("case", list(aarch64_cases.CASES))
def test_same_bits_as_the_host_build(runner, host, case):
    """Every output bit for bit as this machine's build computes it. The kernels sum in a
    fixed order and the build is ISO C (no contraction into fused multiply-adds; the MXFP4
    dot products and the sums through vec16.h's vfmas, MLA attention's among them, fuse on
    both: moe_mxfp4.h mx_dots), so only libm may differ: glibc's
    expf/logf (the MoE router's sigmoid, the attention-residual softmax, the paged decode's
    log-sum-exp) are the same algorithms on both and agree on these inputs, but nothing in
    the kernels promises it."""
    with rk.routed_to(host):
        want = aarch64_cases.CASES[case]()
    with rk.routed_to(runner):
        got = aarch64_cases.CASES[case]()
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        same = a.view(torch.int32) == b.view(torch.int32) if a.dtype == torch.float32 else a == b
        assert bool(same.all()), (case, i, int((~same).sum()), (a.float() - b.float()).abs().max())
