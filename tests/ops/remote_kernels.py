"""The compiled CPU kernels of another instruction set, called from this Python process: the
aarch64 builds (NEON, SVE) under qemu-user on an x86 host, which has no aarch64 Python or torch.

One process per target runs tests/ops/csrc/call_kernel.c (under `qemu-aarch64` for ARM) and
calls the entry points of the kernels' shared libraries, built for that target with the flags
kdaserve/ops/cpu_kernels.py uses. `routed_to(target)` swaps cpu_kernels' library loading for
this one, so the Python wrappers the engine calls (cpu_kernels, cpu_linear, mla, sample_kernel)
run unchanged and their tests' torch references judge the other build's results.

A call ships every tensor storage its pointer arguments point into (found among the calling
frames' tensors, else among all live tensors), runs the function there, and copies the
storages back: in-place updates, aliasing views and strided rows behave as in a local call.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

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


def build(target: Target) -> dict[str, Path]:
    """The driver and one library per csrc/*.c for `target`: {source name: path}, "driver".
    Kept in the kernels' cache folder by a hash of the sources and flags (a cold build of
    the three aarch64 targets takes about a minute on two cores)."""
    flags = [*cpu_kernels._FLAGS, *target.flags, "-fopenmp"]
    sources = sorted(CSRC.glob("*.c"))
    text = b"".join(p.read_bytes() for p in [*sources, *sorted(CSRC.glob("*.h")), DRIVER])
    key = hashlib.sha256(text + " ".join([target.cc, *flags]).encode()).hexdigest()[:16]
    folder = cpu_kernels._cache_dir() / "cross" / f"{target.name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    jobs = {src.name: ([target.cc, *flags, str(src), "-o", "{out}", "-lm"], folder / f"{src.stem}.so")
            for src in sources}
    jobs["driver"] = ([target.cc, "-O2", "-std=c11", *target.flags, str(DRIVER), "-o", "{out}",
                       "-ldl"], folder / "call_kernel")
    todo = [(cmd, out) for cmd, out in jobs.values() if not out.is_file()]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: _compile(*job), todo))
    return {name: out for name, (_, out) in jobs.items()}


def _compile(cmd: list[str], out: Path) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}")
    done = subprocess.run([c.replace("{out}", str(tmp)) for c in cmd], capture_output=True,
                          text=True, timeout=600)
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


@dataclass
class Runner:
    """The driver process of one target, and the libraries it loads."""
    target: Target
    built: dict[str, Path]
    proc: subprocess.Popen = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.proc = subprocess.Popen([*self.target.runner, str(self.built["driver"])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write(struct.pack("<I", 0))
            self.proc.stdin.close()
        self.proc.wait(timeout=30)

    def call(self, source: str, symbol: str, args: list[tuple[str, object]]) -> None:
        """symbol(*args) of csrc/`source`; args are ("i", int), ("f", float) or ("p", address
        or None). The storages the addresses point into are updated as the call left them."""
        spans = _storages([a for kind, a in args if kind == "p" and a])
        req = [struct.pack("<I", 0x4341444B), _str(str(self.built[source])), _str(symbol),
               struct.pack("<I", len(spans))]
        req += [struct.pack("<Q", n) + ctypes.string_at(start, n) for start, n in spans]
        req.append(struct.pack("<I", len(args)))
        for kind, a in args:
            if kind == "i":
                req.append(struct.pack("<Bq", 0, int(a)))
            elif kind == "f":
                req.append(struct.pack("<Bf", 1, float(a)))
            elif a:
                b = next(i for i, (s, n) in enumerate(spans) if s <= a < s + n)
                req.append(struct.pack("<BIQ", 2, b, a - spans[b][0]))
            else:
                req.append(struct.pack("<B", 3))
        with self.lock:
            self.proc.stdin.write(b"".join(req))
            self.proc.stdin.flush()
            (status,) = struct.unpack("<I", self._read(4))
            if status:
                (n,) = struct.unpack("<I", self._read(4))
                raise RuntimeError(f"{symbol}: {self._read(n).decode(errors='replace')}")
            for start, n in spans:
                ctypes.memmove(start, self._read(n), n)

    def _read(self, n: int) -> bytes:
        data = self.proc.stdout.read(n)
        if len(data) != n:
            raise RuntimeError(f"the {self.target.name} kernel process ended (exit "
                               f"{self.proc.poll()}): a crash in the kernel?")
        return data


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


# storages found by a scan of all objects, kept while their tensors live: the fused decode
# blocks' pointers (weights, caches) are built once per model and found in no calling frame
_seen: dict[int, tuple[weakref.ref, int]] = {}


def _tensor_spans(objects, remember: bool = False) -> list[tuple[int, int]]:
    spans = []
    for o in objects:
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.nbytes():
                spans.append((st.data_ptr(), st.nbytes()))
                if remember:
                    _seen[st.data_ptr()] = (weakref.ref(o), st.nbytes())
    return spans


def _remembered() -> list[tuple[int, int]]:
    spans = []
    for start, (ref, n) in list(_seen.items()):
        t = ref()
        if t is None or t.untyped_storage().data_ptr() != start or \
                t.untyped_storage().nbytes() != n:
            del _seen[start]
        else:
            spans.append((start, n))
    return spans


def _storages(addresses: list[int]) -> list[tuple[int, int]]:
    """The (start, bytes) of the tensor storages that hold `addresses`: the calling frames'
    tensors first (cheap), then those an earlier scan found, then all live tensors."""
    frames, f = [], sys._getframe(1)
    while f is not None:
        frames.append(f)
        f = f.f_back
    local = [v for fr in frames for v in fr.f_locals.values()]
    local += [x for v in local if isinstance(v, (list, tuple)) for x in v]
    spans = _tensor_spans(local)

    def owner(a: int) -> tuple[int, int] | None:
        return next(((s, n) for s, n in spans if s <= a < s + n), None)

    if any(owner(a) is None for a in addresses):
        spans += _remembered()
    if any(owner(a) is None for a in addresses):
        spans += _tensor_spans(gc.get_objects(), remember=True)
    out: list[tuple[int, int]] = []
    for a in addresses:
        span = owner(a)
        if span is None:
            raise ValueError(f"address {a:#x} is in no live tensor's storage")
        if span not in out:
            out.append(span)
    # overlapping storages (views of one buffer through different storages) would be shipped
    # twice and written back out of order
    out.sort()
    for (s0, n0), (s1, _) in zip(out, out[1:]):
        assert s0 + n0 <= s1, "overlapping tensor storages"
    return out


_KIND = {ctypes.c_int64: "i", ctypes.c_float: "f", ctypes.c_void_p: "p"}


class RemoteFunction:
    """A ctypes-like function of a remote library: argtypes as the wrappers declare them, or
    none (then ctypes objects say each argument's kind)."""

    def __init__(self, runner: Runner, source: str, name: str, argtypes=None) -> None:
        self.runner, self.source, self.name = runner, source, name
        self.argtypes, self.restype = argtypes, None

    def __call__(self, *args) -> None:
        kinds = ([_KIND[t] for t in self.argtypes] if self.argtypes is not None
                 else [_kind_of(a) for a in args])
        assert len(kinds) == len(args), (self.name, len(kinds), len(args))
        self.runner.call(self.source, self.name, [(k, _value(a)) for k, a in zip(kinds, args)])


def _kind_of(a) -> str:
    if isinstance(a, ctypes.c_float) or isinstance(a, float):
        return "f"
    if a is None or isinstance(a, ctypes.c_void_p):
        return "p"
    return "i"


def _value(a):
    return a.value if isinstance(a, ctypes._SimpleCData) else a


class RemoteLibrary:
    def __init__(self, runner: Runner, source: str) -> None:
        self.runner, self.source = runner, source

    def __getattr__(self, name: str) -> RemoteFunction:
        fn = RemoteFunction(self.runner, self.source, name)
        setattr(self, name, fn)      # one object per name, as ctypes keeps them
        return fn


def _cached_loaders():
    from kdaserve.ops import cpu_linear, mla, registry, sample_kernel

    return [cpu_kernels._library, cpu_kernels._openmp_built,
            cpu_kernels.kda_recurrent_slots_kernel, cpu_kernels.kda_prepare_kernel,
            cpu_kernels.moe_experts_kernel, cpu_kernels.moe_experts_mxfp4_kernel,
            cpu_kernels.decode_block_kernels, sample_kernel.sample_rows_kernel,
            cpu_linear._kernel, mla._paged_decode_kernel, registry._cpu_ops]


@contextlib.contextmanager
def routed_to(runner: Runner) -> Iterator[None]:
    """Within: every compiled kernel the Python side loads is `runner`'s build."""
    from kdaserve.ops import cpu_linear, sample_kernel

    def c_function(source: str, name: str, argtypes: list):
        return RemoteFunction(runner, source, name, argtypes)

    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in (
        (cpu_kernels, "_c_function"), (cpu_kernels, "_library"),
        (cpu_kernels, "_openmp_built"), (sample_kernel, "_c_function"),
        (cpu_linear, "_c_function"))]
    for c in _cached_loaders():
        c.cache_clear()
    cpu_kernels._c_function = sample_kernel._c_function = cpu_linear._c_function = c_function
    cpu_kernels._library = lambda source="kda_cpu.c": RemoteLibrary(runner, source)
    cpu_kernels._openmp_built = lambda source: True     # one call per op: OpenMP splits it
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)
        for c in _cached_loaders():
            c.cache_clear()
