"""How far one `bench spec` run can be trusted on block against token verification.

Both rules run the same prompts with the same seeds, so each request gives a pair of
(accepted drafts, verified blocks) counts, one per rule. The run's figure is a ratio of two
pooled means (tokens per verified block, block rule over token rule); resampling the requests
with their pairs kept (a paired bootstrap) shows how much of it the choice of prompts and
seeds decides. At 128 tokens a request the interval spans about +-8% over 16 requests and
+-3% over 128, so a goal such as "block >= 1.1x token" is judged by the interval, not by the
point alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

Blocks = tuple[int, int]        # (accepted drafts, verified blocks) of one request


def acceptance_length(blocks: Sequence[Blocks]) -> float:
    """Pooled mean tokens per verified block (accepted drafts + 1) over requests."""
    accepted = sum(a for a, _ in blocks)
    verified = sum(v for _, v in blocks)
    return (accepted + verified) / verified if verified else 1.0


def paired_ratio_ci(token: Sequence[Blocks], block: Sequence[Blocks], level: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of acceptance_length(block) / acceptance_length(token) over
    requests resampled with replacement, request i's two counts kept together."""
    if len(token) != len(block) or not token:
        raise ValueError("paired_ratio_ci needs the same requests, at least one, on both sides")
    rng = random.Random(seed)
    n = len(token)
    ratios = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(acceptance_length([block[i] for i in pick])
                      / acceptance_length([token[i] for i in pick]))
    ratios.sort()
    tail = (1.0 - level) / 2
    lo = ratios[int(tail * (resamples - 1))]
    hi = ratios[int((1.0 - tail) * (resamples - 1) + 0.5)]
    return round(lo, 3), round(hi, 3)
