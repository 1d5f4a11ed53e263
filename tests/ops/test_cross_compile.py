"""The compiled CPU kernels build for aarch64 too (NEON through the same vector extensions;
SVE where the target has it), with Debian's cross compiler when it is installed
(`apt-get install gcc-aarch64-linux-gnu`). tests/ops/test_aarch64_qemu.py runs them under
qemu-user against the torch references.

The builds are tests/ops/cross_build.py's, kept by a hash of every source, header and flag:
the armv8-a one is the NEON build test_aarch64_qemu.py runs (the same flags), and a build
whose sources have not changed since it last compiled is not compiled again (each is seconds
of CPU, ~12 of them for decode_cpu.c)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import cross_build as cb
import pytest

CSRC = Path(__file__).parents[2] / "kdaserve" / "ops" / "csrc"
CROSS = shutil.which("aarch64-linux-gnu-gcc")


def _target(march: str) -> cb.Target:
    """The build for -march=`march` (the NEON one is cross_build's own, which qemu runs; SVE
    here is vector-length agnostic, not the fixed lengths qemu runs)."""
    neon = cb.aarch64_targets()[0]
    if (f"-march={march}",) == neon.flags:
        return neon
    return cb.Target(f"compile-{march.replace('+', '_')}", neon.cc, (f"-march={march}",))


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+sve"])
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
def test_kernels_cross_compile_for_aarch64(source, march):
    out = cb.library(_target(march), source)
    assert out.read_bytes()[18] == 0xB7          # ELF e_machine: EM_AARCH64


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (gcc-aarch64-linux-gnu)")
def test_integer_dots_use_the_dot_product_extension():
    """csrc/int_dot.h with __ARM_FEATURE_DOTPROD takes sdot (the emulated targets of
    test_aarch64_qemu.py lack it and run the widening multiplies instead)."""
    out = cb.library(_target("armv8.2-a+dotprod"), "int_linear_cpu.c")
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        text = subprocess.run([objdump, "-d", str(out)], capture_output=True, text=True,
                              check=True).stdout
        assert "\tsdot\t" in text
