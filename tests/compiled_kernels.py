"""Whether a test of the compiled CPU kernels (kdaserve/ops/cpu_kernels.py) may skip.

Only where no kernel can be built here: no C compiler, or KDASERVE_CPU_KERNELS=0. Where a
compiler is present, a kernel that did not build (its C source broken, a flag the compiler
refuses) fails the test instead: the callers fall back to the torch forms silently, so a
skip would hide it."""

from __future__ import annotations

import os
import shutil
from typing import TypeVar

import pytest

T = TypeVar("T")


def c_compiler() -> str | None:
    """The compiler cpu_kernels._build_with would use."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def kernels_expected() -> bool:
    return os.environ.get("KDASERVE_CPU_KERNELS", "1") != "0" and c_compiler() is not None


needs_kernels = pytest.mark.skipif(
    not kernels_expected(), reason="no C compiler, or KDASERVE_CPU_KERNELS=0: the torch forms")


def require(kernel: T | None, what: str) -> T:
    """The kernel; skips where none can be built, fails where one should have been."""
    if kernel is not None:
        return kernel
    if not kernels_expected():
        pytest.skip("no C compiler, or KDASERVE_CPU_KERNELS=0: the torch forms")
    pytest.fail(f"{what} did not build although a C compiler is present ({c_compiler()}): "
                "see the 'kdaserve: building ... failed' warning")
