"""Builds of the compiled CPU kernels for other instruction sets (aarch64: NEON, SVE) with a
cross compiler, the flags kdaserve/ops/cpu_kernels.py uses, and the emulator that runs them;
with the driver that calls their entry points (tests/ops/csrc/call_kernel.c). Used by
tests/ops/remote_kernels.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kdaserve.ops import cpu_kernels

ROOT = Path(__file__).parents[2]
CSRC = ROOT / "kdaserve" / "ops" / "csrc"
DRIVER = Path(__file__).parent / "csrc" / "call_kernel.c"
SYSROOT = "/usr/aarch64-linux-gnu"


@dataclass(frozen=True)
class Target:
    """A build of the kernels and how to run it: compiler, its flags, the emulator command."""
    name: str
    cc: str
    flags: tuple[str, ...]
    runner: tuple[str, ...] = ()


def aarch64_targets() -> list[Target]:
    """NEON (armv8-a), and SVE at fixed vector lengths of 256 and 512 bits (qemu's `max` CPU
    set to that length); the names the tests are parametrised by."""
    cc = shutil.which("aarch64-linux-gnu-gcc") or "aarch64-linux-gnu-gcc"
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static") or "qemu-aarch64"
    out = [Target("neon", cc, ("-march=armv8-a",), (qemu, "-cpu", "max,sve=off", "-L", SYSROOT))]
    for bits in (256, 512):
        out.append(Target(f"sve{bits}", cc, ("-march=armv8.2-a+sve", f"-msve-vector-bits={bits}"),
                          (qemu, "-cpu", f"max,sve{bits}=on", "-L", SYSROOT)))
    return out


def host_target() -> Target:
    """This machine's own build (cpu_kernels' variant), through the same driver: the bitwise
    comparisons' other side."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    return Target("host", cc, ())


def missing_tools() -> str | None:
    """Why the aarch64 targets cannot run here, or None."""
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        return "no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)"
    if not (shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")):
        return "no qemu-aarch64 (apt-get install qemu-user)"
    if not Path(SYSROOT, "lib", "libgomp.so.1").is_file():
        return f"no aarch64 runtime libraries under {SYSROOT} (libgomp1-arm64-cross)"
    return None


def _folder(target: Target) -> tuple[list[str], Path]:
    """The flags of `target`'s libraries and the cache folder of its builds: keyed by a hash
    of every source, header and the driver, the compiler and the flags."""
    flags = [*cpu_kernels._FLAGS, *target.flags, "-fopenmp"]
    text = b"".join(p.read_bytes() for p in [*sorted(CSRC.glob("*.c")),
                                             *sorted(CSRC.glob("*.h")), DRIVER])
    key = hashlib.sha256(text + " ".join([target.cc, *flags]).encode()).hexdigest()[:16]
    folder = cpu_kernels._cache_dir() / "cross" / f"{target.name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    return flags, folder


def library(target: Target, source: str) -> Path:
    """csrc/`source` built for `target` (the same file build() makes and keeps): a build that
    fails raises with the compiler's message."""
    flags, folder = _folder(target)
    out = folder / f"{Path(source).stem}.so"
    if not out.is_file():
        _compile([target.cc, *flags, str(CSRC / source), "-o", "{out}", "-lm"], out)
    return out


def build(target: Target) -> dict[str, Path]:
    """The driver and one library per csrc/*.c for `target`: {source name: path}, "driver".
    Kept in the kernels' cache folder by a hash of the sources and flags (a cold build of
    the three aarch64 targets takes about a minute on two cores)."""
    flags, folder = _folder(target)
    sources = sorted(CSRC.glob("*.c"))
    jobs = {src.name: ([target.cc, *flags, str(src), "-o", "{out}", "-lm"],
                       folder / f"{src.stem}.so") for src in sources}
    jobs["driver"] = ([target.cc, "-O2", "-std=c11", *target.flags, str(DRIVER), "-o", "{out}",
                       "-ldl"], folder / "call_kernel")
    todo = [(cmd, out) for cmd, out in jobs.values() if not out.is_file()]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: _compile(*job), todo))
    return {name: out for name, (_, out) in jobs.items()}


def _compile(cmd: list[str], out: Path) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}")
    done = subprocess.run([c.replace("{out}", str(tmp)) for c in cmd], capture_output=True,
                          text=True, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    os.replace(tmp, out)          # whole files only, whoever else builds the same


def host_build() -> dict[str, Path]:
    """This machine's own libraries, as cpu_kernels builds them, and a native driver."""
    built = {src.name: cpu_kernels._build(src) for src in sorted(CSRC.glob("*.c"))}
    missing = [name for name, path in built.items() if path is None]
    if missing:
        raise RuntimeError(f"the host kernels did not build: {missing}")
    t = host_target()
    key = hashlib.sha256(DRIVER.read_bytes() + t.cc.encode()).hexdigest()[:16]
    driver = cpu_kernels._cache_dir() / "cross" / f"host-driver-{key}"
    driver.parent.mkdir(parents=True, exist_ok=True)
    if not driver.is_file():
        _compile([t.cc, "-O2", "-std=c11", str(DRIVER), "-o", "{out}", "-ldl"], driver)
    return {**built, "driver": driver}
