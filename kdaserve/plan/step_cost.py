"""What an engine step costs, as a function of what the scheduler put in it: the shape of a
step, and the cost models `kdaserve plan --simulate` charges for it (the roofline of a layout,
kdaserve/plan/model.py, or a linear model fitted to a machine's measured steps).

The fitted model is S = a + b·prefill_tokens + c·decode_rows + d·prefill_rows seconds:
a is the fixed work of a step (scheduling, sampling, the Python around the forward), b a
prompt token's forward, c a decode row's (on CPU the single-token kernels; its context is read
whole), d a prompt chunk's own overhead (the chunked KDA setup, its last position's logits).
Context length is not a regressor: on the short prompts a calibration runs it is noise, and
the roofline charges it where it matters.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    fixed: float                # a
    per_prefill_token: float    # b
    per_decode_row: float       # c
    per_prefill_row: float      # d

    def seconds(self, shape: StepShape) -> float:
        return (self.fixed + self.per_prefill_token * shape.prefill_tokens
                + self.per_decode_row * shape.decode_rows
                + self.per_prefill_row * shape.prefill_rows)

    def to_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed, "per_prefill_token_s": self.per_prefill_token,
                "per_decode_row_s": self.per_decode_row,
                "per_prefill_row_s": self.per_prefill_row}


def _features(shapes: list[StepShape]) -> np.ndarray:
    return np.array([[1.0, s.prefill_tokens, s.decode_rows, s.prefill_rows] for s in shapes],
                    dtype=np.float64)


def fit_linear(shapes: list[StepShape], seconds: list[float]) -> tuple[LinearCost, float]:
    """Ordinary least squares over measured steps. Unweighted on purpose: with an intercept
    the residuals sum to zero, so the fitted steps' total equals the measured total, which is
    what throughput and queueing delays are made of (a relative weighting would fit the many
    short decode steps and miss the few long prompt chunks). Steps more than 3x off the first
    fit (a pause: another process on the machine) are left out of the second. A negative
    coefficient (collinear regressors) is refitted without its regressor. Returns the model
    and its relative RMS error over the steps kept."""
    if len(shapes) < 4:
        raise ValueError(f"fitting a step cost needs at least 4 steps, got {len(shapes)}")
    x, y = _features(shapes), np.asarray(seconds, dtype=np.float64)
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(4)
    for _ in range(2):
        cols = list(range(4))
        while True:
            sol = np.linalg.lstsq(x[keep][:, cols], y[keep], rcond=None)[0]
            coef = np.zeros(4)
            coef[cols] = sol
            neg = [c for c in cols if coef[c] < 0]
            if not neg:
                break
            cols.remove(neg[0])
        pred = np.maximum(x @ coef, 1e-9)
        keep = np.maximum(pred / y, y / pred) < 3.0
        if keep.sum() < 4:
            keep[:] = True
    rel = (x @ coef - y) / y
    return LinearCost(*(float(c) for c in coef)), float(np.sqrt(np.mean(rel[keep] ** 2)))
