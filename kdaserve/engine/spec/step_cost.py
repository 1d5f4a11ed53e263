"""What a step costs on this machine, measured online, for adaptive speculation
(engine/spec/adaptive.py): a linear model of step seconds fit by least squares over the last
steps, and the tokens per second decode steps actually delivered with and without verifying
drafts (the check on the linear model). No tensors here.

Cost model: a step takes S = a + b·tokens + c·drafting_rows + d·[it verifies drafts] seconds
(a: fixed per-step work, b: per token in the forward, c: per request the drafter runs for,
d: what leaving the plain decode path costs: on CPU a step without drafts may take the fused
single-token kernels, a verifying step takes the torch forward).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FEATURES = 4          # 1, tokens, drafting rows, verifies


@dataclass
class StepCostModel:
    """Online least squares of step seconds on (1, tokens, drafting rows, verifies), lightly
    pulled towards a prior so that it is defined from the first step. The normal equations
    are kept as running sums over the window (a sample leaving it is subtracted), so a fit
    costs one 4x4 solve, not a pass over the window, and is solved only when a plan asks for
    it (every step while the drafter is awake; a sleeping drafter's steps only add their
    sample)."""

    window: int = 512
    prior: tuple[float, ...] = (5e-3, 5e-5, 2e-4, 0.0)
    warmup: int = 3            # the first steps build kernels and caches: not typical
    seen: int = 0
    samples: deque = field(default_factory=deque)
    # preconditioning: tokens are ~100x the other regressors
    _scale: tuple[float, ...] = (1.0, 100.0, 1.0, 1.0)
    _xx: list = field(default_factory=lambda: [[0.0] * FEATURES for _ in range(FEATURES)])
    _xy: list = field(default_factory=lambda: [0.0] * FEATURES)
    _fit: tuple[float, ...] | None = None      # None: samples came since the last solve
    _last: tuple[float, ...] | None = None     # the last solve's result

    def predict(self, tokens: float, drafting_rows: float, verifies: bool,
                fit: tuple[float, ...] | None = None) -> float:
        """Seconds of such a step, by `fit` (default: the current coefficients)."""
        a, b, c, d = fit if fit is not None else self.coefficients()
        return a + b * tokens + c * drafting_rows + (d if verifies else 0.0)

    def observe(self, tokens: int, drafting_rows: int, seconds: float,
                verifies: bool = False) -> None:
        self.seen += 1
        if seconds <= 0 or self.seen <= self.warmup:
            return
        if len(self.samples) >= 8:            # a pause (GC, another process) is not a cost
            # against the last fit, stale or not: a solve per step would cost more than the
            # clip is worth (this runs every step, the drafter asleep or not)
            seconds = min(seconds, 4.0 * self.predict(tokens, drafting_rows, verifies,
                                                      self._last))
        row = (1.0, float(tokens), float(drafting_rows), float(verifies), seconds)
        self.samples.append(row)
        self._add(row, 1.0)
        if len(self.samples) > self.window:
            self._add(self.samples.popleft(), -1.0)
        self._fit = None

    def _add(self, row: tuple[float, ...], sign: float) -> None:
        x = [v / s for v, s in zip(row, self._scale)]
        y = sign * row[FEATURES]
        xy, xx = self._xy, self._xx
        for i in range(FEATURES):
            xi = x[i]
            if not xi:           # a step without drafts: most products are zero
                continue
            xy[i] += xi * y
            si, r = sign * xi, xx[i]
            for j in range(FEATURES):
                if x[j]:
                    r[j] += si * x[j]

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, c, d), each >= 0 (a tiny floor keeps ratios finite; d may be 0)."""
        if not self.samples:
            return tuple(self.prior)          # type: ignore[return-value]
        if self._fit is None:
            lam = 1.0        # ridge weight, in units of one step
            m = [[self._xx[i][j] + (lam if i == j else 0.0) for j in range(FEATURES)]
                 for i in range(FEATURES)]
            v = [self._xy[i] + lam * self.prior[i] * self._scale[i] for i in range(FEATURES)]
            w = _solve(m, v)
            floor = (1e-7, 1e-7, 1e-7, 0.0)
            self._fit = (tuple(self.prior) if w is None else
                         tuple(max(w[i] / self._scale[i], floor[i]) for i in range(FEATURES)))
            self._last = self._fit
        return self._fit                      # type: ignore[return-value]


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (the system is small and well posed)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-18:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for j in range(col, n + 1):
                a[r][j] -= f * a[col][j]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][j] * out[j] for j in range(r + 1, n))) / a[r][r]
    return out


@dataclass
class RealizedRates:
    """Tokens per second that decode steps actually delivered, per batch-size bucket (powers
    of two): steps that verified drafts, plain steps with the drafter awake, and plain steps
    with it asleep. The check on the cost model, which is linear and can misjudge a verifying
    step's cost where the forward is not (many rows of k + 1 tokens). Decayed sums, so the
    figures follow the machine's current load.

    Verifying steps are compared with the better of the two plain rates: the alternative to
    speculating is sleeping, and an asleep engine runs decode bursts without capture. Against
    the awake plain steps alone, speculation looked like a win where it lost: the Kimi Linear
    demo at batch 1 delivered 0.56 tokens a ms verifying, 0.40 in awake plain steps and 0.77
    asleep (docs/benchmarks.md).

    Each kind's rate follows its own last steps, and a host's speed moves by a third over
    seconds, so a verifying rate measured minutes ago in a fast moment can beat a plain rate
    measured in a slow one: the Kimi Linear demo then verified 16-18 blocks at 14 of 18 wakes,
    at 0.9x the asleep rate.
    Verifying steps are therefore also set against the better plain rate of their own moment
    (`against`: the tokens they produced over the tokens plain steps would have produced in
    their seconds), and speculation loses where either comparison says so."""

    decay: float = 0.95
    min_steps: int = 8
    sums: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    # per bucket: decayed tokens verifying steps produced, the tokens the plain rate of each
    # one's moment would have produced in its seconds, and how many steps
    against: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, rows: int, verifies: bool, produced: int, seconds: float,
                asleep: bool = False) -> None:
        if rows <= 0 or seconds <= 0:
            return
        kind = "verify" if verifies else "asleep" if asleep else "awake"
        if verifies and (plain := self._plain_rate(rows)) is not None:
            rel = self.against.setdefault(rows.bit_length(), [0.0, 0.0, 0])
            rel[0] = rel[0] * self.decay + produced
            rel[1] = rel[1] * self.decay + seconds * plain
            rel[2] += 1
        acc = self.sums.setdefault((rows.bit_length(), kind), [0.0, 0.0, 0, 0.0])
        acc[0] = acc[0] * self.decay + produced
        acc[1] = acc[1] * self.decay + seconds
        acc[2] += 1
        acc[3] = acc[3] * self.decay + rows         # rows, decayed as the seconds are

    def _measured(self, rows: int, kind: str) -> list[float] | None:
        acc = self.sums.get((max(1, rows).bit_length(), kind))
        return acc if acc is not None and acc[2] >= self.min_steps else None

    def needs_plain(self, rows: int) -> bool:
        """Verifying steps have been measured here but plain ones not enough to compare: when
        speculation stays on from the first step (a request's first drafts are planned on the
        prior), nothing else would ever time a plain step of this batch size."""
        return self._measured(rows, "verify") is not None and self._plain_rate(rows) is None

    def needs_asleep(self, rows: int) -> bool:
        """Verifying steps have been measured here but the asleep engine's steps not: the
        plain rate speculation must beat is not known yet (awake plain steps understate it)."""
        return (self._measured(rows, "verify") is not None
                and self._measured(rows, "asleep") is None)

    def _plain_rate(self, rows: int) -> float | None:
        """The better of the two plain rates measured here (None: neither yet)."""
        plain = [acc[0] / acc[1] for acc in (self._measured(rows, "awake"),
                                            self._measured(rows, "asleep")) if acc is not None]
        return max(plain) if plain else None

    def cannot_pay(self, rows: int, block: float) -> bool:
        """At `block` tokens a row a step, verifying steps as long as the measured ones would
        deliver fewer tokens a second than the asleep engine. The Kimi Linear demo on 2 CPU
        cores: 6.9 ms a verifying step (its draft's proposal included) at batch 1, 8 tokens
        at most, against 1.56 tokens a ms asleep."""
        spec, asleep = self._measured(rows, "verify"), self._measured(rows, "asleep")
        if spec is None or asleep is None:
            return False
        best = block * spec[3] / spec[1]             # tokens a second at `block` a row
        return best < asleep[0] / asleep[1]

    def speculation_loses(self, rows: int) -> bool:
        """Verifying steps have delivered fewer tokens per second here than the better of
        the plain ones: as rates (the plain steps' own last ones), or against the plain
        rate of each verifying step's moment."""
        rel = self.against.get(max(1, rows).bit_length())
        if rel is not None and rel[2] >= self.min_steps and rel[0] < rel[1]:
            return True
        spec, plain = self._measured(rows, "verify"), self._plain_rate(rows)
        if spec is None or plain is None:
            return False
        return spec[0] / spec[1] < plain
