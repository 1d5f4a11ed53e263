"""What an engine step costs, as a function of what the scheduler put in it: the shape of a
step, and the cost models `kdaserve plan --simulate` charges for it (the roofline of a layout,
kdaserve/plan/model.py, or a linear model fitted to a machine's measured steps).

The fitted model follows the CPU engine's two paths. A step of decode rows alone takes the
fused single-token kernels: a_d + c·rows. A step with a prompt chunk runs the torch forward
over all its tokens: a_p + b·tokens + d·prompt_chunks (b a token's forward, decode rows riding
along included; d a chunk's own overhead: the chunked KDA setup, its last position's logits).
The two fixed costs (scheduling, sampling, the Python around either forward) differ: the torch
forward's module calls cost more than the fused kernels'. Context length is not a regressor:
on the short prompts a calibration runs it is noise, and the roofline charges it where it
matters.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass
from typing import Protocol

import numpy as np

from kdaserve.outputs import SchedulerOutput
from kdaserve.plan.model import Roofline


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int         # tokens of prompt chunks (and recomputed outputs)
    prefill_rows: int
    decode_rows: int            # one token each, its context in the cache
    kv_tokens: int              # cached tokens the step's attention reads

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        pre = [s for s in out.sequences if not s.is_decode]
        return cls(sum(len(s.token_ids) for s in pre), len(pre),
                   len(out.sequences) - len(pre),
                   sum(s.context_len + len(s.token_ids) for s in out.sequences))

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows

    @property
    def rows(self) -> int:
        return self.prefill_rows + self.decode_rows


class StepCost(Protocol):
    def seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class RooflineCost:
    """The plan's roofline for one dp replica's steps (the other replicas run alike)."""

    roof: Roofline

    def seconds(self, shape: StepShape) -> float:
        return self.roof.seconds(shape.tokens, shape.rows, shape.kv_tokens,
                                 replicas=self.roof.dp)


@dataclass(frozen=True)
class LinearCost:
    decode_fixed: float         # a_d
    per_decode_row: float       # c
    prompt_fixed: float         # a_p
    per_token: float            # b
    per_prompt_chunk: float     # d

    def seconds(self, shape: StepShape) -> float:
        return float(_features([shape])[0] @ np.array(astuple(self)))

    def to_dict(self) -> dict[str, float]:
        return {f"{k}_s": v for k, v in asdict(self).items()}


def _features(shapes: list[StepShape]) -> np.ndarray:
    rows = []
    for s in shapes:
        prompt = s.prefill_rows > 0
        rows.append([0.0 if prompt else 1.0, 0 if prompt else s.decode_rows,
                     1.0 if prompt else 0.0, s.tokens if prompt else 0, s.prefill_rows])
    return np.array(rows, dtype=np.float64)


def fit_linear(shapes: list[StepShape], seconds: list[float]) -> tuple[LinearCost, float]:
    """Ordinary least squares over measured steps. Unweighted on purpose: the two fixed terms
    together are an intercept, so the residuals sum to zero and the fitted steps' total equals
    the measured total, which is what throughput and queueing delays are made of (a relative
    weighting would fit the many short decode steps and miss the few long prompt chunks).
    Steps more than 3x off the first fit (a pause: another process on the machine) are left
    out of the second, unless that would leave out half of them. A negative coefficient
    (collinear regressors) is refitted without its regressor. Returns the model and its
    relative RMS error over the steps kept."""
    if len(shapes) < 5:
        raise ValueError(f"fitting a step cost needs at least 5 steps, got {len(shapes)}")
    x, y = _features(shapes), np.asarray(seconds, dtype=np.float64)
    keep = np.ones(len(y), dtype=bool)
    n = x.shape[1]
    coef = np.zeros(n)
    for _ in range(2):
        cols = list(range(n))
        while True:
            sol = np.linalg.lstsq(x[keep][:, cols], y[keep], rcond=None)[0]
            coef = np.zeros(n)
            coef[cols] = sol
            neg = [c for c in cols if coef[c] < 0]
            if not neg:
                break
            cols.remove(neg[0])
        pred = np.maximum(x @ coef, 1e-9)
        keep = np.maximum(pred / y, y / pred) < 3.0
        if keep.sum() < max(n, len(y) // 2):     # the fit itself is off: keep all
            keep[:] = True
    rel = (x @ coef - y) / y
    return LinearCost(*(float(c) for c in coef)), float(np.sqrt(np.mean(rel[keep] ** 2)))
