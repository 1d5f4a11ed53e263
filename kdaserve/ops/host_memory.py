"""Host allocator settings for CPU inference.

glibc serves allocations above its mmap threshold (128 KiB at start, rising only as such
blocks are freed) with fresh mmap'd pages, and returns freed memory at the heap top to the
OS. A decode step allocates many multi-MiB temporaries (gathered contexts, states, expert
buffers) whose pages then fault in again on every step: on the 2-core development machine
that was ~20% of a 64-request decode step. Raising the mmap threshold to glibc's maximum and
keeping freed memory in the process makes those allocations reuse warm pages.
KDASERVE_TUNE_MALLOC=0 leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os

log = logging.getLogger("kdaserve")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20        # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)
_TRIM_THRESHOLD = 1 << 30
_done = False


def tune_host_allocator() -> bool:
    """Apply the settings once per process; True when glibc took them."""
    global _done
    if _done or os.environ.get("KDASERVE_TUNE_MALLOC", "1") == "0":
        return _done
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not ok:
        log.debug("kdaserve: mallopt refused the allocator settings")
    _done = ok
    return ok


def freeze_startup_heap() -> None:
    """Move every object alive now (the model's modules, the tokenizer's tables, imported
    code) out of the cyclic collector's reach, as vLLM does after its startup. Python's full
    collections walk every tracked object, and a decode loop's small allocations trigger them
    often enough that they took ~7% of a single-stream step on the bundled demo (perf, AVX2
    machine). Frozen objects are still freed by reference counting; only cycles among them
    would outlive their last reference, so what an earlier freeze kept (an engine closed
    since, in a process that starts several: tests, benches) is thawed and collected first.
    KDASERVE_GC_FREEZE=0 leaves the collector alone."""
    if os.environ.get("KDASERVE_GC_FREEZE", "1") == "0":
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
