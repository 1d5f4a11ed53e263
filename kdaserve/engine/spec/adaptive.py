"""Adaptive speculation: how many drafts each request verifies, chosen per step from that
request's measured acceptance and from what a step costs on this machine, measured online.

Cost model: a step takes S = a + b·tokens + c·drafting_rows + d·[it verifies drafts] seconds
(a: fixed per-step work, b: per token in the forward, c: per request the drafter runs for,
d: what leaving the plain decode path costs: on CPU a step without drafts may take the fused
single-token kernels, a verifying step takes the torch forward), fit by least squares over the
last steps. Gain model: request r accepts each draft with probability α_r (an exponential
moving average of its verified drafts, counted as Bernoulli trials up to the first rejection;
a new request starts from the engine-wide average), so drafting k yields Σ_{j≤k} α_r^j extra
tokens in expectation.

A step produces N tokens in S seconds; one more draft for r at depth j adds α_r^j tokens and
b seconds (plus c for r's first draft). It pays iff it raises N/S. Each request takes the k
that maximises Σ_{j≤k} α^j − (N/S)·(c·[k>0] + b·k); then the whole plan is kept only if its
N/S, d included, beats the plan without drafts, and unless verifying steps have actually
delivered fewer tokens per second than plain ones at this batch size (`RealizedRates`: the
check on a linear model). k = 0 turns speculation off for a request.
Requests that stopped speculating are probed with a block of drafts now and then, so a better stretch
of text is noticed, but probes are paid from a budget: at most `probe_share` of the predicted
step time, so that a draft that never pays costs at most that much.

An idle drafter still costs: the target's hidden states are captured every step, projected
into the draft's pages, and the proposer runs. So after `sleep_after` plans in a row in which
no request earned a draft, and once at least `sleep_trials` blocks were verified since it woke
(probes count: the evidence), the drafter sleeps (`dormant`): steps capture nothing, project
nothing and propose nothing, the plan is all zeros and nothing is probed. It wakes when a
request is admitted after `wake_after` steps asleep, or at another batch-size bucket than the
one it fell asleep at if that bucket has not been woken for `wake_after` steps. Each wake that
finds nothing worth drafting doubles the wait before the next (up to `max_wake_after`).

The probing rate, documented: awake, probes cost at most `probe_share` of the predicted step
time; asleep, none. A wake costs about `sleep_after` awake plans (capture and projection of
their rows) plus `sleep_trials` probe blocks (the sleep waits for that evidence), and comes at
most once per wait (`wake_after`, doubling), or once per `wake_after` steps per batch-size
bucket.
A request that ran while the drafter slept is drafted after the wake from the context captured
since (the draft's context cannot be rebuilt from the target's cache: see
engine/spec/dspark.py `missed`); a request admitted at the wake is captured from its start.
No tensors here.
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
    """Tokens per second that decode steps actually delivered, with and without verifying
    drafts, per batch-size bucket (powers of two): the check on the cost model, which is
    linear and can misjudge a verifying step's cost where the forward is not (many rows of
    k + 1 tokens). Decayed sums, so the figures follow the machine's current load."""

    decay: float = 0.95
    min_steps: int = 8
    sums: dict[tuple[int, bool], list[float]] = field(default_factory=dict)

    def observe(self, rows: int, verifies: bool, produced: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        acc = self.sums.setdefault((rows.bit_length(), verifies), [0.0, 0.0, 0])
        acc[0] = acc[0] * self.decay + produced
        acc[1] = acc[1] * self.decay + seconds
        acc[2] += 1

    def needs_plain(self, rows: int) -> bool:
        """Verifying steps have been measured here but plain ones not enough to compare: when
        speculation stays on from the first step (a request's first drafts are planned on the
        prior), nothing else would ever time a plain step of this batch size."""
        b = max(1, rows).bit_length()
        spec, plain = self.sums.get((b, True)), self.sums.get((b, False))
        return (spec is not None and spec[2] >= self.min_steps
                and (plain is None or plain[2] < self.min_steps))

    def speculation_loses(self, rows: int) -> bool:
        """Verifying steps have delivered fewer tokens per second than plain ones here."""
        b = max(1, rows).bit_length()
        spec, plain = self.sums.get((b, True)), self.sums.get((b, False))
        if spec is None or plain is None or min(spec[2], plain[2]) < self.min_steps:
            return False
        return spec[0] / spec[1] < plain[0] / plain[1]


@dataclass
class AdaptiveSpeculation:
    max_drafts: int
    prior_acceptance: float = 0.5
    ema: float = 0.2               # weight of each new trial in a request's acceptance
    probe_every: int = 16          # steps a request waits at least between probes
    probe_share: float = 0.03      # of the predicted step time, at most, spent on probes
    sleep_after: int | None = 32   # plans in a row without an earned draft: sleep (None: never)
    wake_after: int = 256          # steps asleep before an admission wakes the drafter
    sleep_trials: int = 2          # verified blocks since waking, at least, before a sleep
    max_wake_after: int = 1 << 14
    cost: StepCostModel = field(default_factory=StepCostModel)
    realized: RealizedRates = field(default_factory=RealizedRates)
    alpha: dict[str, float] = field(default_factory=dict)
    _idle: dict[str, int] = field(default_factory=dict)
    _credit: float = 0.0           # seconds of probing earned and not yet spent
    # what the last plans decided, for /metrics
    steps: int = 0
    steps_speculating: int = 0
    drafts_planned: int = 0
    last_drafts: int = 0           # drafts the last plan verifies, over all requests
    last_speculating: int = 0      # requests the last plan gave k > 0
    dormant: bool = False          # the drafter sleeps: no capture, no proposals, no probes
    sleeps: int = 0

    def __post_init__(self) -> None:
        self.shared_alpha = self.prior_acceptance   # where a new request starts
        self._probing: set[str] = set()
        self._streak = 0           # plans in a row in which nobody earned a draft
        self._asleep = 0           # steps since the drafter fell asleep
        self._sleep_bucket = 0
        self._wait = self.wake_after
        self._earned_since_wake = True    # the first sleep waits wake_after
        self._trials_since_wake = 0       # verified blocks: the evidence a sleep rests on
        self._bucket_woken: dict[int, int] = {}   # batch-size bucket -> step of its last wake

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification: `accepted` of `drafted` drafts stood (a prefix of them)."""
        a = self.alpha.get(request_id, self.shared_alpha)
        self._trials_since_wake += drafted > 0
        trials = accepted + (1 if accepted < drafted else 0)
        for i in range(trials):
            hit = 1.0 if i < accepted else 0.0
            a += self.ema * (hit - a)
            self.shared_alpha += self.ema * (hit - self.shared_alpha) / 4
        self.alpha[request_id] = a

    def forget(self, request_id: str) -> None:
        self.alpha.pop(request_id, None)
        self._idle.pop(request_id, None)
        self._probing.discard(request_id)

    def plan(self, candidates: dict[str, int], base_tokens: int) -> dict[str, int]:
        """candidates: request -> drafts available (at most); base_tokens: the step's tokens
        without drafts. Returns request -> drafts to verify this step."""
        if self.dormant:
            self._asleep += 1
            self.steps += 1
            self.last_drafts = self.last_speculating = 0
            return dict.fromkeys(candidates, 0)
        a, b, c, d = self.cost.coefficients()
        plain_n = max(1.0, float(len(candidates)))
        plain_s = a + b * base_tokens
        produced, seconds = plain_n, plain_s
        out: dict[str, int] = {}
        for _ in range(2):                    # the ratio depends on the choices: iterate once
            ratio = produced / seconds
            out, extra_tokens, extra_rows, extra_gain = {}, 0, 0, 0.0
            for rid, avail in candidates.items():
                al = self.alpha.get(rid, self.shared_alpha)
                k = self._best_k(al, min(avail, self.max_drafts), ratio, b, c)
                out[rid] = k
                if k:
                    extra_gain += sum(al ** j for j in range(1, k + 1))
                    extra_tokens += k
                    extra_rows += 1
            produced = plain_n + extra_gain
            seconds = a + b * (base_tokens + extra_tokens) + c * extra_rows + (
                d if extra_rows else 0.0)
        if extra_rows and (produced / seconds <= plain_n / plain_s
                           or self.realized.speculation_loses(len(candidates))
                           or self.realized.needs_plain(len(candidates))):
            # the verifying step's own cost is not repaid (or, a few times per batch size,
            # a plain step is timed so that the realized rates can be compared)
            out = dict.fromkeys(out, 0)
        if candidates:              # prefill-only steps say nothing about drafting
            self._note_earned(any(out.values()), len(candidates))
        if self.dormant:            # fell asleep now: the plan it had is dropped too
            self.steps += 1
            self.last_drafts = self.last_speculating = 0
            return dict.fromkeys(candidates, 0)
        # a probe spans two steps: its draft is proposed after one and verified in the next
        for rid in self._probing & candidates.keys():
            out[rid] = max(out[rid], min(candidates[rid], self.max_drafts))
            self._idle[rid] = 0
        self._probing = set()
        self._probe(out, candidates, b, c, d, plain_s)
        self.steps += 1
        planned = sum(out.values())
        self.drafts_planned += planned
        self.steps_speculating += planned > 0
        self.last_drafts = planned
        self.last_speculating = sum(1 for k in out.values() if k)
        return out

    def _note_earned(self, earned: bool, rows: int) -> None:
        if earned:
            self._streak, self._earned_since_wake = 0, True
            return
        self._streak += 1
        # asleep only on evidence: a few verified blocks (probes count) since waking, else a
        # drafter whose first trials have not come yet would never get them
        if self.sleep_after is not None and self._streak >= self.sleep_after \
                and not self._probing and self._trials_since_wake >= self.sleep_trials:
            self.dormant, self._asleep, self._streak = True, 0, 0
            self._trials_since_wake = 0
            self._sleep_bucket = max(1, rows).bit_length()
            self.sleeps += 1
            # a wake that found nothing: wait longer before the next
            self._wait = (self.wake_after if self._earned_since_wake
                          else min(2 * self._wait, self.max_wake_after))
            self._earned_since_wake = False

    def admitted(self, rows: int) -> None:
        """A request was admitted (its prompt starts now) into a batch of `rows`: wake the
        drafter if it has slept long enough, or the batch size moved to another bucket."""
        if not self.dormant:
            return
        bucket = max(1, rows).bit_length()
        moved = (bucket != self._sleep_bucket
                 and self.steps - self._bucket_woken.get(bucket, -self.wake_after)
                 >= self.wake_after)
        if self._asleep >= self._wait or moved:
            self.dormant, self._streak = False, 0
            self._bucket_woken[bucket] = self.steps
            # the credit of the probes a sleep needs as evidence: the woken drafter tries its
            # blocks at once rather than staying awake (capturing, proposing: ~15% of a fused
            # CPU step) for the hundreds of steps probe_share would take to earn them
            a, b, c, d = self.cost.coefficients()
            self._credit = max(self._credit,
                               2 * max(1, self.sleep_trials) * (b * self.max_drafts + c + d))

    def initial_drafts(self, base_tokens: int) -> int:
        """Drafts to propose for a request that has not decoded yet (its prompt is being
        prefilled): what the engine-wide acceptance earns it, charged the verifying step's
        fixed cost as if it were the only request to verify."""
        if self.dormant or self.realized.speculation_loses(base_tokens):
            return 0
        a, b, c, d = self.cost.coefficients()
        ratio = max(1.0, float(base_tokens)) / (a + b * base_tokens)
        return self._best_k(self.shared_alpha, self.max_drafts, ratio, b, c + d)

    def _probe(self, out: dict[str, int], candidates: dict[str, int], b: float, c: float,
               d: float, step_seconds: float) -> None:
        """A full block of drafts for the request idle the longest, when the budget affords
        it: a verifying step's fixed cost dominates a probe, so one draft would buy one trial
        where the block buys up to max_drafts (and its accepted tokens)."""
        self._credit = min(self._credit + self.probe_share * step_seconds, 1.0)
        idle = []
        for rid in candidates:
            if out[rid] == 0:
                self._idle[rid] = self._idle.get(rid, 0) + 1
                if self._idle[rid] >= self.probe_every and candidates[rid] > 0:
                    idle.append(rid)
            else:
                self._idle[rid] = 0
        idle = [r for r in idle if out[r] == 0]
        if not idle:
            return
        rid = max(idle, key=lambda r: self._idle[r])
        k = min(candidates[rid], self.max_drafts)
        cost = b * k + c + (0.0 if any(out.values()) else d)
        if self._credit >= cost:
            out[rid], self._idle[rid] = k, 0
            self._probing.add(rid)
            self._credit -= 2 * cost            # the proposal now, the verification next

    def decisions(self) -> dict[str, float]:
        """What it decided, for /metrics: counters since start and the last plan's state."""
        return {"adaptive_steps": self.steps, "steps_speculating": self.steps_speculating,
                "drafts_planned": self.drafts_planned, "last_drafts": self.last_drafts,
                "last_requests_speculating": self.last_speculating,
                "enabled": 1.0 if self.last_drafts else 0.0,
                "dormant": 1.0 if self.dormant else 0.0, "sleeps": self.sleeps,
                "mean_acceptance_estimate": (sum(self.alpha.values()) / len(self.alpha)
                                             if self.alpha else self.shared_alpha)}

    @staticmethod
    def _best_k(alpha: float, avail: int, ratio: float, b: float, c: float) -> int:
        best_k, best, gain = 0, 0.0, 0.0
        for k in range(1, avail + 1):
            gain += alpha ** k
            value = gain - ratio * (c + b * k)
            if value > best:
                best_k, best = k, value
        return best_k
