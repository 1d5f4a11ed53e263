"""Which instruction set the compiled CPU kernels are built for, chosen at run time.

The kernels' tiles are sized from the target's registers (csrc/outer_tiles.h, kda_step.h:
32 vector registers of 16 lanes with AVX-512, 16 of 8 lanes with AVX2, 32 of 4 with NEON),
so the variant is a build of its own: `-march=x86-64-v4` (AVX-512), `-march=x86-64-v3` (AVX2 +
FMA), or the compiler's `-march=native` (ARM: NEON, and SVE where present). By default the
machine's own (native). `KDASERVE_CPU_ISA=avx2|avx512|native` forces one, so an AVX-512
machine measures the AVX2 build honestly; a variant this CPU cannot execute is refused (the
torch forms run).
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

VARIANTS = ("avx2", "avx512", "native")
_MARCH = {"avx2": "-march=x86-64-v3", "avx512": "-march=x86-64-v4", "native": "-march=native"}
# what each x86 variant needs from the CPU (/proc/cpuinfo flags)
_NEEDS = {"avx2": {"avx2", "fma", "bmi2"},
          "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"}}


@cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_isa() -> str:
    """What `native` builds for here: avx512, avx2, sve, neon, or the machine's name."""
    machine = platform.machine().lower()
    flags = cpu_flags()
    if machine in ("x86_64", "amd64"):
        if _NEEDS["avx512"] <= flags:
            return "avx512"
        return "avx2" if _NEEDS["avx2"] <= flags else "x86-64"
    if machine in ("aarch64", "arm64"):
        return "sve" if "sve" in flags else "neon"
    return machine


def runnable(variant: str) -> bool:
    """Whether this CPU executes the variant's code."""
    if variant == "native":
        return True
    return platform.machine().lower() in ("x86_64", "amd64") and _NEEDS[variant] <= cpu_flags()


def runnable_variants() -> list[str]:
    """Every forced variant this machine can execute (the tests run the kernels on each)."""
    return [v for v in ("avx2", "avx512") if runnable(v)]


def requested() -> str:
    v = os.environ.get("KDASERVE_CPU_ISA", "native").strip().lower() or "native"
    if v not in VARIANTS:
        raise ValueError(f"KDASERVE_CPU_ISA={v!r}: use one of {', '.join(VARIANTS)}")
    return v


def march_flag(variant: str) -> str:
    return _MARCH[variant]


def cpu_isa() -> str:
    """The variant the kernels are built for in this process (startup logs and bench JSON):
    the forced one, or `native` resolved to what it means here."""
    v = requested()
    return native_isa() if v == "native" else v


@cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; empty where it says none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def llc_bytes() -> int:
    """The last-level cache of this CPU (sysfs; 32 MiB when it says nothing). A virtual
    machine may report its host's whole cache, of which it gets less (docs/benchmarks.md,
    thirty-third session: 480 MiB reported, reads past 128 MiB at the memory's rate)."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 32 << 20
