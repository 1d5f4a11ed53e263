"""Adaptive speculation: how many drafts each request verifies, chosen per step from that
request's measured acceptance and from what a step costs on this machine, measured online.

Cost model: a step takes S = a + b·tokens + c·drafting_rows seconds (a: fixed per-step work,
b: per token in the forward, c: per request the drafter runs for), fit by least squares over the
last steps. Gain model: request r accepts each draft with probability α_r (an exponential
moving average of its verified drafts, counted as Bernoulli trials up to the first rejection),
so drafting k yields Σ_{j≤k} α_r^j extra tokens in expectation.

A step produces N tokens in S seconds; one more draft for r at depth j adds α_r^j tokens and
b seconds (plus c for r's first draft). It pays iff it raises N/S, i.e. iff gain / cost >
N / S. Each request takes the k that maximises Σ_{j≤k} α^j − (N/S)·(c·[k>0] + b·k); k = 0
turns speculation off for it. A request whose k is 0 is probed with one draft every
`probe_every` steps, so a better stretch of text is noticed. No tensors here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepCostModel:
    """Online least squares of step seconds on (1, tokens, drafting rows), lightly pulled
    towards a prior so that it is defined from the first step."""

    window: int = 512
    prior: tuple[float, float, float] = (5e-3, 5e-5, 2e-4)
    samples: deque = field(default_factory=lambda: deque(maxlen=512))
    warmup: int = 3            # the first steps build kernels and caches: not typical
    seen: int = 0

    def observe(self, tokens: int, drafting_rows: int, seconds: float) -> None:
        self.seen += 1
        if seconds <= 0 or self.seen <= self.warmup:
            return
        if len(self.samples) >= 8:            # a pause (GC, another process) is not a cost
            a, b, c = self.coefficients()
            seconds = min(seconds, 4.0 * (a + b * tokens + c * drafting_rows))
        self.samples.append((1.0, float(tokens), float(drafting_rows), seconds))

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c), each >= 0 (a tiny floor keeps ratios finite)."""
        n = len(self.samples)
        lam = 1.0        # ridge weight, in units of one step
        # normal equations (X'X + lam·I) w = X'y + lam·prior, 3x3, solved by Cramer's rule
        scale = (1.0, 100.0, 1.0)     # tokens are ~100x the other regressors: precondition
        m = [[lam if i == j else 0.0 for j in range(3)] for i in range(3)]
        v = [lam * p * s for p, s in zip(self.prior, scale)]      # the prior, scaled too
        for row in self.samples:
            x = [row[i] / scale[i] for i in range(3)]
            for i in range(3):
                v[i] += x[i] * row[3]
                for j in range(3):
                    m[i][j] += x[i] * x[j]
        w = _solve3(m, v) if n else None
        if w is None:
            return self.prior
        return tuple(max(w[i] / scale[i], 1e-7) for i in range(3))   # type: ignore[return-value]


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    d = _det3(m)
    if abs(d) < 1e-18:
        return None
    out = []
    for col in range(3):
        mc = [[v[i] if j == col else m[i][j] for j in range(3)] for i in range(3)]
        out.append(_det3(mc) / d)
    return out


@dataclass
class AdaptiveSpeculation:
    max_drafts: int
    prior_acceptance: float = 0.5
    ema: float = 0.2               # weight of each new trial in a request's acceptance
    probe_every: int = 16
    cost: StepCostModel = field(default_factory=StepCostModel)
    alpha: dict[str, float] = field(default_factory=dict)
    _idle: dict[str, int] = field(default_factory=dict)
    # what the last plans decided, for /metrics
    steps: int = 0
    steps_speculating: int = 0
    drafts_planned: int = 0
    last_drafts: int = 0           # drafts the last plan verifies, over all requests
    last_speculating: int = 0      # requests the last plan gave k > 0

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification: `accepted` of `drafted` drafts stood (a prefix of them)."""
        a = self.alpha.get(request_id, self.prior_acceptance)
        trials = accepted + (1 if accepted < drafted else 0)
        for i in range(trials):
            hit = 1.0 if i < accepted else 0.0
            a += self.ema * (hit - a)
        self.alpha[request_id] = a

    def forget(self, request_id: str) -> None:
        self.alpha.pop(request_id, None)
        self._idle.pop(request_id, None)

    def plan(self, candidates: dict[str, int], base_tokens: int) -> dict[str, int]:
        """candidates: request -> drafts available (at most); base_tokens: the step's tokens
        without drafts. Returns request -> drafts to verify this step."""
        a, b, c = self.cost.coefficients()
        produced = max(1.0, float(len(candidates)))
        seconds = a + b * base_tokens
        out: dict[str, int] = {}
        for _ in range(2):                    # the ratio depends on the choices: iterate once
            ratio = produced / seconds
            out, extra_tokens, extra_rows, extra_gain = {}, 0, 0, 0.0
            for rid, avail in candidates.items():
                k = self._best_k(self.alpha.get(rid, self.prior_acceptance),
                                 min(avail, self.max_drafts), ratio, b, c)
                out[rid] = k
                if k:
                    al = self.alpha.get(rid, self.prior_acceptance)
                    extra_gain += sum(al ** j for j in range(1, k + 1))
                    extra_tokens += k
                    extra_rows += 1
            produced = max(1.0, float(len(candidates))) + extra_gain
            seconds = a + b * (base_tokens + extra_tokens) + c * extra_rows
        for rid in candidates:                # probe requests that stopped speculating
            if out[rid] == 0:
                idle = self._idle.get(rid, 0) + 1
                if idle >= self.probe_every and candidates[rid] > 0:
                    out[rid], idle = 1, 0
                self._idle[rid] = idle
            else:
                self._idle[rid] = 0
        self.steps += 1
        planned = sum(out.values())
        self.drafts_planned += planned
        self.steps_speculating += planned > 0
        self.last_drafts = planned
        self.last_speculating = sum(1 for k in out.values() if k)
        return out

    def decisions(self) -> dict[str, float]:
        """What it decided, for /metrics: counters since start and the last plan's state."""
        return {"adaptive_steps": self.steps, "steps_speculating": self.steps_speculating,
                "drafts_planned": self.drafts_planned, "last_drafts": self.last_drafts,
                "last_requests_speculating": self.last_speculating,
                "enabled": 1.0 if self.last_drafts else 0.0,
                "mean_acceptance_estimate": (sum(self.alpha.values()) / len(self.alpha)
                                             if self.alpha else self.prior_acceptance)}

    @staticmethod
    def _best_k(alpha: float, avail: int, ratio: float, b: float, c: float) -> int:
        best_k, best, gain = 0, 0.0, 0.0
        for k in range(1, avail + 1):
            gain += alpha ** k
            value = gain - ratio * (c + b * k)
            if value > best:
                best_k, best = k, value
        return best_k
