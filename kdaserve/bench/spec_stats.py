"""How far one `bench spec` run can be trusted on block against token verification.

Both rules run the same prompts with the same seeds, so each request gives a pair of
(accepted drafts, verified blocks) counts, one per rule. The run's figure is a ratio of two
pooled means (tokens per verified block, block rule over token rule); resampling the requests
with their pairs kept (a paired bootstrap) shows how much of it the choice of prompts and
seeds decides. At 128 tokens a request the interval spans about +-8% over 16 requests and
+-3% over 128, so a goal such as "block >= 1.1x token" is judged by the interval, not by the
point alone.

Speed is judged the same way (`paired_speed_ci`): each repeat of a row times the plain and the
speculative side back to back, so each repeat gives one paired ratio, and the interval over the
repeats says whether "spec_vs_plain >= 0.97" is shown or is within the host's noise.
"""

from __future__ import annotations

import math
import random
import statistics
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


# Student's t at 0.975 by degrees of freedom (a 95% two-sided interval); 2.0 past 30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

Run = tuple[float, int]         # (seconds, tokens) of one side of one repeat


def paired_speed_ci(base: Sequence[Run], spec: Sequence[Run]
                    ) -> tuple[float, float | None, float | None]:
    """(geometric mean, 95% low, 95% high) of the speculative side's speed over the plain
    side's, repeat by repeat: a t interval of the mean log ratio. A repeat's two sides ran
    back to back, so the host's slow drift (its read rate moves over seconds) cancels within
    each pair; what is left varies from pair to pair, and the interval says how much."""
    if len(base) != len(spec) or not base:
        raise ValueError("paired_speed_ci needs the same repeats, at least one, on both sides")
    logs = [math.log((ns / ts) / (nb / tb)) for (tb, nb), (ts, ns) in zip(base, spec)]
    mean = statistics.fmean(logs)
    if len(logs) == 1:          # no spread to go by
        return round(math.exp(mean), 3), None, None
    df = len(logs) - 1
    half = ((_T975[df - 1] if df <= len(_T975) else 2.0) * statistics.stdev(logs)
            / math.sqrt(len(logs)))
    return (round(math.exp(mean), 3), round(math.exp(mean - half), 3),
            round(math.exp(mean + half), 3))
