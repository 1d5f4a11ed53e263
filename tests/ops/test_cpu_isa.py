"""The compiled kernels' instruction-set variants (kdaserve/ops/cpu_isa.py): chosen at run
time, forced with KDASERVE_CPU_ISA, and the kernel tests pass on every variant this machine
can execute (each in a process of its own: a process builds its kernels once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sub_pytest import run_pytest

from kdaserve.ops import cpu_isa

ROOT = Path(__file__).parents[2]


def test_the_requested_variant(monkeypatch):
    monkeypatch.delenv("KDASERVE_CPU_ISA", raising=False)
    assert cpu_isa.requested() == "native"
    assert cpu_isa.cpu_isa() == cpu_isa.native_isa()
    monkeypatch.setenv("KDASERVE_CPU_ISA", "AVX2")
    assert cpu_isa.requested() == "avx2" and cpu_isa.cpu_isa() == "avx2"
    assert cpu_isa.march_flag("avx2") == "-march=x86-64-v3"
    monkeypatch.setenv("KDASERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="avx2, avx512, native"):
        cpu_isa.requested()


def test_native_names_what_this_cpu_has():
    native = cpu_isa.native_isa()
    flags = cpu_isa.cpu_flags()
    if native == "avx512":
        assert "avx512f" in flags and cpu_isa.runnable("avx2")
    elif native == "avx2":
        assert "avx2" in flags and not cpu_isa.runnable("avx512")
    assert cpu_isa.runnable("native")
    assert set(cpu_isa.runnable_variants()) <= {"avx2", "avx512"}


@pytest.mark.parametrize("variant", cpu_isa.runnable_variants() or ["none"])
def test_kernel_tests_pass_on_each_variant(variant):
    if variant == "none":
        pytest.skip("this CPU runs no forced x86 variant (native only)")
    env = {**os.environ, "KDASERVE_CPU_ISA": variant}
    done = run_pytest(["-x", "tests/ops/test_cpu_kernels.py", "tests/ops/test_cpu_linear.py",
                       "tests/ops/test_cpu_int_linear.py", "tests/ops/test_moe_int_kernel.py"],
                      env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


def test_a_variant_this_cpu_cannot_run_falls_back_to_torch():
    missing = [v for v in ("avx2", "avx512") if not cpu_isa.runnable(v)]
    if not missing:
        pytest.skip("this CPU runs every x86 variant")
    code = ("from kdaserve.ops import cpu_kernels as k; "
            "print(k.kda_recurrent_slots_kernel() is None)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "KDASERVE_CPU_ISA": missing[0]})
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert "cannot execute" in done.stderr
