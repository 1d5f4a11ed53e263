"""The compiled CPU kernels build for aarch64 too (NEON through the same vector extensions;
SVE where the target has it), with Debian's cross compiler when it is installed
(`apt-get install gcc-aarch64-linux-gnu`). tests/ops/test_aarch64_qemu.py runs them under
qemu-user against the torch references."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).parents[2] / "kdaserve" / "ops" / "csrc"
CROSS = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+sve"])
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
def test_kernels_cross_compile_for_aarch64(source, march, tmp_path):
    out = tmp_path / "k.so"
    done = subprocess.run(
        [CROSS, "-O3", f"-march={march}", "-fno-math-errno", "-fno-trapping-math", "-shared",
         "-fPIC", "-std=c11", "-fopenmp", str(CSRC / source), "-o", str(out), "-lm"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes()[18] == 0xB7          # ELF e_machine: EM_AARCH64


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (gcc-aarch64-linux-gnu)")
def test_integer_dots_use_the_dot_product_extension(tmp_path):
    """csrc/int_dot.h with __ARM_FEATURE_DOTPROD takes sdot (the emulated targets of
    test_aarch64_qemu.py lack it and run the widening multiplies instead)."""
    out = tmp_path / "k.so"
    done = subprocess.run(
        [CROSS, "-O3", "-march=armv8.2-a+dotprod", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC", "-std=c11", "-fopenmp", str(CSRC / "int_linear_cpu.c"), "-o",
         str(out), "-lm"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        text = subprocess.run([objdump, "-d", str(out)], capture_output=True, text=True,
                              check=True).stdout
        assert "\tsdot\t" in text
