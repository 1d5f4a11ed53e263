"""kdaserve: an inference and serving engine for hybrid KDA + MLA MoE models (Kimi Linear family)."""

from __future__ import annotations

import os

# numpy's bundled OpenBLAS starts a worker thread per core when numpy is imported, and its
# workers poll for a while after waking; kdaserve gives numpy no BLAS work worth threads (the
# model runs on torch's and the kernels' OpenMP threads), and on a small machine the poller
# takes time from them (~1% of a single-stream decode's samples on 2 cores). A user's setting
# wins; numpy imported before kdaserve has its pool already.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Weights in transparent huge pages: decode reads every weight once a token, and in 4 KiB pages
# each 4 KiB of a stream costs a TLB miss and a restart of the hardware prefetcher. torch's own
# switch puts its CPU allocations of 2 MiB or more in huge pages; it is read at torch's first
# allocation, so it is set here, before kdaserve imports torch (a process that imported torch
# first keeps its setting: kdaserve/ops/host_memory.py advises the decode weights then).
if os.environ.get("KDASERVE_HUGE_PAGES", "1") != "0":
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import kdaserve.config` does not pull torch and the engine.
    if name == "LLM":
        from kdaserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kdaserve.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
