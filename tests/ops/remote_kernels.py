"""The compiled CPU kernels of another instruction set, called from this Python process: the
aarch64 builds (NEON, SVE) under qemu-user on an x86 host, which has no aarch64 Python or torch.

One process per target runs tests/ops/csrc/call_kernel.c (under `qemu-aarch64` for ARM) and
calls the entry points of the kernels' shared libraries, built for that target with the flags
kdaserve/ops/cpu_kernels.py uses (tests/ops/cross_build.py). `routed_to(runner)` swaps
cpu_kernels' library loading for that process, so the Python wrappers the engine calls
(cpu_kernels, cpu_linear, mla, sample_kernel, fused_decode) run unchanged and their tests'
torch references judge the other build's results.

A call ships every tensor storage its pointer arguments point into (found among the calling
frames' tensors, else among all live tensors), runs the function there, and copies the
storages back: in-place updates, aliasing views and strided rows behave as in a local call.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cross_build import Target

from kdaserve.ops import cpu_kernels


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
    for (s0, n0), (s1, _) in itertools.pairwise(out):
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
    if isinstance(a, (ctypes.c_float, float)):
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
    from kdaserve.ops import cpu_int_linear, cpu_linear, mla, moe_kernel, registry, sample_kernel

    return [cpu_int_linear._kernel, cpu_int_linear._experts_kernel,
            cpu_kernels._library, cpu_kernels._openmp_built,
            cpu_kernels.kda_recurrent_slots_kernel, cpu_kernels.kda_prepare_kernel,
            moe_kernel.moe_experts_kernel, moe_kernel.moe_experts_mxfp4_kernel,
            cpu_kernels.decode_block_kernels, sample_kernel.sample_rows_kernel,
            sample_kernel.row_probs_kernel,
            cpu_linear._kernel, mla._paged_decode_kernel, registry._cpu_ops]


@contextlib.contextmanager
def routed_to(runner: Runner) -> Iterator[None]:
    """Within: every compiled kernel the Python side loads is `runner`'s build."""
    from kdaserve.ops import cpu_int_linear, cpu_linear, moe_kernel, sample_kernel

    def c_function(source: str, name: str, argtypes: list):
        return RemoteFunction(runner, source, name, argtypes)

    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in (
        (cpu_kernels, "_c_function"), (cpu_kernels, "_library"),
        (cpu_kernels, "_openmp_built"), (sample_kernel, "_c_function"),
        (cpu_linear, "_c_function"), (cpu_int_linear, "_c_function"),
        (moe_kernel, "_c_function"))]
    for c in _cached_loaders():
        c.cache_clear()
    cpu_kernels._c_function = sample_kernel._c_function = cpu_linear._c_function = c_function
    cpu_int_linear._c_function = moe_kernel._c_function = c_function
    cpu_kernels._library = lambda source="kda_cpu.c": RemoteLibrary(runner, source)
    cpu_kernels._openmp_built = lambda source: True     # one call per op: OpenMP splits it
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)
        for c in _cached_loaders():
            c.cache_clear()
