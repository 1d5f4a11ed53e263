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
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("kdaserve")

_SRC = Path(__file__).parent / "csrc" / "kda_cpu.c"
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]


def _cache_dir() -> Path:
    root = os.environ.get("KDASERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kdaserve")
    return Path(root) / "kernels"


def _build(src: Path) -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256(src.read_bytes() + " ".join([cc, *_FLAGS, platform.machine(),
                                                      platform.node()]).encode()).hexdigest()[:16]
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
            subprocess.run([cc, *_FLAGS, str(src), "-o", tmp, "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp, out)  # atomic: concurrent builders each install a whole file
            return out
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("kdaserve: building %s failed (%s); using the torch reference. %s",
                        src.name, e, detail.decode(errors="replace")[-500:])
            Path(tmp).unlink(missing_ok=True)
            return None
    return None


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


# below this many (row, position, head) steps a call stays on one thread
_PARALLEL_MIN_STEPS = 4096


@lru_cache(maxsize=None)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="kdaserve-kernel")


KDARecurrentSlots = Callable[..., torch.Tensor]


@lru_cache(maxsize=None)
def kda_recurrent_slots_kernel() -> KDARecurrentSlots | None:
    """The compiled in-place KDA recurrence, or None (no compiler, disabled, build failed)."""
    if os.environ.get("KDASERVE_CPU_KERNELS", "1") == "0":
        return None
    lib_path = _build(_SRC)
    if lib_path is None:
        return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as e:
        log.warning("kdaserve: loading %s failed (%s); using the torch reference", lib_path, e)
        return None
    fn = lib.kda_recurrent_slots
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

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
        rest = (L, H, K, V, _ptr(q_), _ptr(k_), _ptr(v_), _ptr(g_), _ptr(beta_), _ptr(o),
                _ptr(kept), keep_every)
        n = min(torch.get_num_threads(), B)
        if n <= 1 or B * L * H < _PARALLEL_MIN_STEPS:
            fn(_ptr(store), _ptr(slots_), 0, B, *rest)
            return o
        bounds = [B * i // n for i in range(n + 1)]
        futures = [_pool(n).submit(fn, _ptr(store), _ptr(slots_), bounds[i], bounds[i + 1],
                                   *rest) for i in range(n)]
        for f in futures:
            f.result()
        return o

    return run
