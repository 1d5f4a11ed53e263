"""kdaserve: an inference and serving engine for hybrid KDA + MLA MoE models
(Kimi Linear family)."""

from __future__ import annotations

import os

# numpy's bundled OpenBLAS starts a worker thread per core when numpy is imported, and its
# workers poll for a while after waking; kdaserve gives numpy no BLAS work worth threads (the
# model runs on torch's and the kernels' OpenMP threads), and on a small machine the poller
# takes time from them (~1% of a single-stream decode's samples on 2 cores). A user's setting
# wins; numpy imported before kdaserve has its pool already.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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
