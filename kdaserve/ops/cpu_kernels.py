"""Compiled CPU kernels: small C sources under ops/csrc, built with the system C compiler on
first use (cached per source and machine), called through ctypes on tensors' memory.

Plain C with a C ABI keeps the build to a second (no torch headers) and the kernels free of
Python overhead. When no compiler is found or the build fails, `kda_recurrent_slots_kernel()`
returns None and callers use the torch reference; KDASERVE_CPU_KERNELS=0 forces that.

A decode step runs on the calling thread: it is bound by reading each state once (64 rows of
the demo model: ~0.2 ms per layer with one thread or two). Prefill rows, where the recurrence
is compute-bound, are split between a pool of torch's thread count (ctypes releases the GIL;
rows are independent, so the result does not depend on the split).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from kdaserve.ops import cpu_isa, stream_ahead

log = logging.getLogger("kdaserve")

_CSRC = Path(__file__).parent / "csrc"
# -march comes from the variant (kdaserve/ops/cpu_isa.py)
# an undeclared function is an error, as GCC 14 makes it: a helper that one target's branch
# calls but only another target defines fails every build here, not just a newer compiler's
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=c11",
          "-Werror=implicit-function-declaration"]


def _cache_dir() -> Path:
    root = os.environ.get("KDASERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kdaserve")
    return Path(root) / "kernels"


# sources whose kernels run on threads of their own when the compiler has OpenMP (they share
# torch's libgomp: csrc/decode_cpu.c); built without it where it is missing
_OPENMP_SOURCES = {"decode_cpu.c", "kda_cpu.c", "mla_cpu.c", "moe_cpu.c", "int_linear_cpu.c",
                   "sample_cpu.c"}


def _build(src: Path, cflags: str | None = None) -> Path | None:
    if src.name in _OPENMP_SOURCES:
        return (_build_with(src, ["-fopenmp"], cflags=cflags)
                or _build_with(src, [], quiet=False, cflags=cflags))
    return _build_with(src, [], quiet=False, cflags=cflags)


def _build_with(src: Path, extra: list[str], quiet: bool = True,
                cflags: str | None = None) -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    variant = cpu_isa.requested()
    if not cpu_isa.runnable(variant):
        log.warning("kdaserve: KDASERVE_CPU_ISA=%s, which this CPU (%s) cannot execute; "
                    "using the torch reference", variant, cpu_isa.native_isa())
        return None
    # KDASERVE_KERNEL_CFLAGS: more flags, for an A/B build of a kernel's tunable (a -D of its
    # headers' #ifndef constants, docs/benchmarks.md); part of the cache key like the rest
    more = os.environ.get("KDASERVE_KERNEL_CFLAGS", "") if cflags is None else cflags
    flags = [*_FLAGS, cpu_isa.march_flag(variant), *extra, *more.split()]
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
    key = hashlib.sha256(src.read_bytes() + headers + " ".join(
        [cc, *flags, platform.machine(), platform.node()]).encode()).hexdigest()[:16]
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "kdaserve-kernels"):
        out = folder / f"{src.stem}-{key}.so"
        if out.is_file():
            return out
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:  # not writable: try the next place
            continue
        os.close(fd)
        try:
            subprocess.run([cc, *flags, str(src), "-o", tmp, "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, out)  # atomic: concurrent builders each install a whole file
            return out
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            if not quiet:
                log.warning("kdaserve: building %s failed (%s); using the torch reference. %s",
                            src.name, e, detail.decode(errors="replace")[-500:])
            Path(tmp).unlink(missing_ok=True)
            return None
    return None


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


# below this many (row, position, head) steps a call stays on one thread
_PARALLEL_MIN_STEPS = 4096


@cache
def thread_pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="kdaserve-kernel")


KDARecurrentSlots = Callable[..., torch.Tensor]


@cache
def _library(source: str = "kda_cpu.c") -> ctypes.CDLL | None:
    """The compiled kernels of csrc/`source`, or None (no compiler, disabled, build or load
    failed)."""
    if os.environ.get("KDASERVE_CPU_KERNELS", "1") == "0":
        return None
    lib_path = _build(_CSRC / source)
    if lib_path is None:
        return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as e:
        log.warning("kdaserve: loading %s failed (%s); using the torch reference", lib_path, e)
        return None
    stream_ahead.loaded(lib)
    return lib


def library_name(source: str) -> str | None:
    """The file name of csrc/`source`'s build (its cache key), or None where none is built."""
    lib = _library(source)
    return Path(lib._name).name if lib is not None else None


def tune_dir() -> Path:
    """Where per-machine measurements of the kernels' tunables are kept (stream_ahead.py)."""
    return _cache_dir().parent / "tune"


def build_library(src: Path, cflags: str = "") -> ctypes.CDLL | None:
    """Another build of a kernel source (a second csrc/ tree, other -D flags) beside the
    default one: `kdaserve bench blocks --against-*` times the two side by side. It takes the
    measured stream distance too, unless its flags set one."""
    lib_path = _build(src, cflags)
    if lib_path is None:
        return None
    lib = ctypes.CDLL(str(lib_path))
    if "IDOT_STREAM_AHEAD" not in cflags:
        stream_ahead.loaded(lib)
    return lib


def _split_rows(fn: Callable[..., None], num_rows: int, work: int, *args) -> None:
    """fn(row_begin, row_end, *args) over rows [0, num_rows), on the pool when there is enough
    work (rows are independent, so the split does not change the result)."""
    n = min(torch.get_num_threads(), num_rows)
    if n <= 1 or work < _PARALLEL_MIN_STEPS:
        fn(0, num_rows, *args)
        return
    bounds = [num_rows * i // n for i in range(n + 1)]
    futures = [thread_pool(n).submit(fn, bounds[i], bounds[i + 1], *args) for i in range(n)]
    for f in futures:
        f.result()


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def parallel_rows(source: str, fn: Callable[..., None], num_rows: int, work: int,
                  *args, pool: bool = True) -> None:
    """fn(row_begin, row_end, nthreads, *args) of csrc/`source` over rows [0, num_rows). Built
    with OpenMP, the kernel splits them over torch's own threads (a pool of ours beside them
    competed with torch's workers, which spin for a while after each op: on two cores a
    prefill's KDA kernels ran at half speed); otherwise they split over a pool here, or with
    pool=False stay on the calling thread."""
    if _openmp_built(source):
        fn(0, num_rows, torch.get_num_threads() if work >= _PARALLEL_MIN_STEPS else 1, *args)
    elif pool:
        _split_rows(fn, num_rows, work, 1, *args)
    else:
        fn(0, num_rows, 1, *args)


@cache
def _openmp_built(source: str) -> bool:
    lib = _library(source)
    if lib is None or not hasattr(lib, "kernels_parallel"):
        return False
    lib.kernels_parallel.restype = ctypes.c_int64
    return bool(lib.kernels_parallel())


def _c_function(source: str, name: str, argtypes: list) -> Callable[..., None] | None:
    """The void C function `name` of csrc/`source` with its argument types, or None."""
    lib = _library(source)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = argtypes
    return fn


@cache
def kda_recurrent_slots_kernel() -> KDARecurrentSlots | None:
    """The compiled in-place KDA recurrence, or None (no compiler, disabled, build failed)."""
    fn = _c_function("kda_cpu.c", "kda_recurrent_slots",
                     [_I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR,
                      _PTR, _PTR, _PTR, _PTR, _I64])
    if fn is None:
        return None

    def run(store: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            kept: torch.Tensor | None = None, keep_every: int = 1) -> torch.Tensor:
        """store [S,H,K,V] fp32 (updated in place), slots [B] int64; q,k,g [B,L,H,K],
        v [B,L,H,V], beta [B,L,H] (fp32); kept [B,L/keep_every,H,K,V] or None is filled with
        the state after every keep_every-th position. Returns o [B,L,H,V]."""
        B, L, H, K = q.shape
        V = v.shape[-1]
        args = [t.contiguous() for t in (slots, q, k, v, g, beta)]
        assert store.is_contiguous() and store.dtype == torch.float32
        assert all(t.dtype == torch.float32 for t in args[1:]) and args[0].dtype == torch.int64
        assert L % keep_every == 0 and (kept is None or kept.is_contiguous())
        o = torch.empty(B, L, H, V, dtype=torch.float32)
        slots_, q_, k_, v_, g_, beta_ = args
        parallel_rows("kda_cpu.c", fn, B, B * L * H, _ptr(store), _ptr(slots_), L, H, K, V,
                      _ptr(q_), _ptr(k_), _ptr(v_), _ptr(g_), _ptr(beta_), _ptr(o), _ptr(kept),
                      keep_every)
        return o

    return run


KDAPrepare = Callable[..., tuple[torch.Tensor, ...]]


@cache
def kda_prepare_kernel() -> KDAPrepare | None:
    """The compiled conv + activations + norms + decay of a KDA layer's inputs, or None."""
    fn = _c_function("kda_cpu.c", "kda_prepare",
                     [_I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR,
                      _I64, _PTR, _PTR, _F32, _I64, _PTR, _I64, _F32, _PTR, _PTR, _PTR, _PTR,
                      _PTR, _PTR])
    if fn is None:
        return None

    def run(pre: torch.Tensor, window: torch.Tensor, cu_seqlens: torch.Tensor,
            conv_wt: torch.Tensor, fraw: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor,
            braw: torch.Tensor, num_heads: int, q_scale: float,
            lower_bound: float | None = None) -> tuple[torch.Tensor, ...]:
        """pre [T,3HD] q|k|v before the conv, window [B,W,3HD] the inputs before each
        sequence, cu_seqlens [B+1] int64, conv_wt [W+1,3HD], fraw [T,HD] (f_b_proj output),
        dt_bias [HD], a [H] = exp(A_log), braw [T,H]; all fp32, rows of pre, fraw and braw may
        be strided. Returns q, k, v, g [T,H,D], beta [T,H] and the new window [B,W,3HD]."""
        T, C = pre.shape
        B, W = window.shape[0], window.shape[1]
        H = num_heads
        D = C // (3 * H)
        for t in (pre, fraw, braw):
            assert t.dtype == torch.float32 and t.stride(-1) == 1
        window, conv_wt, dt_bias, a, cu = (t.contiguous() for t in (window, conv_wt, dt_bias, a,
                                                                     cu_seqlens))
        assert window.dtype == conv_wt.dtype == dt_bias.dtype == a.dtype == torch.float32
        assert conv_wt.shape == (W + 1, C) and cu.dtype == torch.int64 and cu.numel() == B + 1
        q, k, v, g = (torch.empty(T, H, D, dtype=torch.float32) for _ in range(4))
        beta = torch.empty(T, H, dtype=torch.float32)
        new_window = torch.empty(B, W, C, dtype=torch.float32)
        parallel_rows("kda_cpu.c", fn, B, T * H * 8, _ptr(cu), W + 1, H, D, _ptr(pre),
                      pre.stride(0), _ptr(window), _ptr(conv_wt), _ptr(fraw), fraw.stride(0),
                      _ptr(dt_bias), _ptr(a), 0.0 if lower_bound is None else float(lower_bound),
                      int(lower_bound is not None), _ptr(braw), braw.stride(0), float(q_scale),
                      _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(new_window))
        return q, k, v, g, beta, new_window

    return run


@cache
def decode_block_kernels(weights: str = "f32"):
    """The fused single-token decode blocks of csrc/decode_cpu.c (kda, mla, mlp, moe, head, and
    mix: K3's attention-residual mix) for
    fp32 ("f32") or bf16 ("bf16") weights and cache, or None. Called with ctypes objects built
    once per model (kdaserve.model.fused_decode), so no argument types are declared: each call
    converts nothing."""
    lib = _library("decode_cpu.c")
    return decode_table(lib, weights) if lib is not None else None


def decode_table(lib: ctypes.CDLL, weights: str):
    """decode_block_kernels' table from a loaded build of decode_cpu.c."""
    from types import SimpleNamespace

    fns = {}
    for key in ("kda", "mla", "mlp", "moe"):
        fn = getattr(lib, f"{key}_decode_block_{weights}")
        fn.restype = None
        fns[key] = fn
    fns["head"] = getattr(lib, f"head_block_{weights}")
    fns["head"].restype = None
    fns["mix"] = lib.attn_res_mix_rows          # K3's attention residuals (fp32 activations)
    fns["mix"].restype = None
    fns["embed"] = lib.embed_rows               # the rows' embeddings (fp32 or bf16 table)
    fns["embed"].restype = ctypes.c_int64
    # the blocks run their work on several threads themselves (csrc/threads.h): the caller
    # should not split rows over threads of its own on top
    lib.kernels_parallel.restype = ctypes.c_int64
    fns["parallel"] = bool(lib.kernels_parallel())
    fns["threads"] = lib.decode_blocks_threads
    fns["threads"].restype = None
    fns["threads"].argtypes = [ctypes.c_int64]
    return SimpleNamespace(**fns)
