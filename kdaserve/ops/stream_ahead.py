"""The prefetch distance of a lone decode row's INT weight streams (csrc/int_row4.h), held for
every kernel library: each library that exports kdaserve_set_stream_ahead is registered as it
loads (cpu_kernels) and takes the chosen distance, now and whenever it changes. The choice is
measured per machine by ops/stream_tune.py. The distance moves no result: only when the weights
are asked for.
"""

from __future__ import annotations

import ctypes

BUILT = 256                        # csrc/int_row4.h IDOT_STREAM_AHEAD
ENV = "KDASERVE_STREAM_AHEAD"      # bytes, set without measuring; 0: as built

_chosen: int | None = None
_libraries: list[ctypes.CDLL] = []


def chosen() -> int | None:
    return _chosen


def current() -> int:
    """The distance now (the built one until a choice)."""
    return _chosen if _chosen is not None else BUILT


def loaded(lib: ctypes.CDLL) -> None:
    """A kernel library was loaded (cpu_kernels): it takes the chosen distance, now and later."""
    if hasattr(lib, "kdaserve_set_stream_ahead"):
        lib.kdaserve_set_stream_ahead.restype = ctypes.c_int64
        _libraries.append(lib)
        if _chosen is not None:
            lib.kdaserve_set_stream_ahead(ctypes.c_int64(_chosen))


def choose(nbytes: int | None) -> None:
    """Every library reads `nbytes` ahead (None: no choice, the built distance)."""
    global _chosen
    _chosen = nbytes
    for lib in _libraries:
        lib.kdaserve_set_stream_ahead(ctypes.c_int64(current()))
