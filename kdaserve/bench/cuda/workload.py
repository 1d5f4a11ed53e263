"""What `kdaserve bench cuda` runs: the two bundled models, and the sizes of every section
(full on a GPU, `--tiny` on a CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.assets import DEMO_MODEL_DIR, KIMI_LINEAR_DEMO_DIR

MODELS = {"kimi_k3": DEMO_MODEL_DIR, "kimi_linear": KIMI_LINEAR_DEMO_DIR}


@dataclass(frozen=True)
class Sizes:
    correctness_prompts: int = 3
    correctness_tokens: int = 64
    kda_check: tuple[int, int, int, int] = (2, 512, 4, 64)      # B, T, H, D
    kda_time_len: int = 8192
    single_in: int = 128
    single_out: int = 256
    batch: int = 32
    batch_in: int = 128
    batch_out: int = 128
    batch64: int = 64               # issue 30's batch-64 figure (Kimi Linear demo)
    prefill: int = 2048
    spec_prompts: int = 2
    spec_tokens: int = 128
    spec_k: int = 7
    long_contexts: tuple[int, ...] = (1024, 16384, 131072)
    long_decode: int = 32
    long_chunk: int = 8192
    repeats: int = 3


TINY = Sizes(correctness_prompts=2, correctness_tokens=4, kda_check=(1, 40, 2, 16),
             kda_time_len=64, single_in=8, single_out=4, batch=3, batch_in=8, batch_out=3,
             batch64=4,
             prefill=32, spec_prompts=1, spec_tokens=4, spec_k=3, long_contexts=(64, 128),
             long_decode=3, long_chunk=64, repeats=1)
