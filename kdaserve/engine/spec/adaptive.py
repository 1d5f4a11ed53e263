"""Adaptive speculation: how many drafts each request verifies, chosen per step from that
request's measured acceptance and from what a step costs on this machine, measured online
(engine/spec/step_cost.py: S = a + b·tokens + c·drafting_rows + d·[it verifies drafts]).

Gain model: request r accepts each draft with probability α_r (an exponential moving average
of its verified drafts, counted as Bernoulli trials up to the first rejection), so drafting k
yields Σ_{j≤k} α_r^j extra tokens in expectation. A new request starts from the engine-wide
acceptance of its kind (`SharedAcceptance`, one for greedy and one for sampled requests, the
latter from a lower prior: a draft that greedy text accepts 70% of the time may accept 20%
of sampled text, and one figure for both let greedy stretches wake the drafter for sampled
batches it could not pay for).

A step produces N tokens in S seconds; one more draft for r at depth j adds α_r^j tokens and
b seconds (plus c for r's first draft). Each request takes the k that maximises
Σ_{j≤k} α^j − (N/S)·(c·[k>0] + b·k); the plan is kept only if its N/S, d included, beats the
plan without drafts, and unless verifying steps have actually delivered fewer tokens per
second than plain ones at this batch size (`RealizedRates`). k = 0 turns speculation off for
a request. Requests that stopped speculating are probed with a block of drafts now and then,
paid from a budget of at most `probe_share` of the predicted step time.

An idle drafter sleeps, and wakes on admissions (spec/drafter_rest.py); the blocks owed after
each wake go at once to requests with no acceptance of their own, outside the budget.

The probing rate, documented: awake, at most `probe_share` of the predicted step time plus
the owed `sleep_trials` blocks per wake; asleep, none. A wake costs about `sleep_after` awake
plans and `sleep_trials` probe blocks (the trials alone where the realized rates veto
verifying). Once a batch size's verifying steps are measured, a nap of at most `nap_steps`
times its asleep steps, the rate they must beat (at most once per `wake_after` plans a
bucket; docs/speculation-sampling.md). A request that ran while the drafter slept is drafted
after the wake from the context captured since (engine/spec/dspark.py `missed`).
No tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.engine.spec.acceptance import SharedAcceptance, best_drafts, choose_drafts
from kdaserve.engine.spec.drafter_rest import DrafterRest
from kdaserve.engine.spec.step_cost import RealizedRates, StepCostModel


@dataclass
class AdaptiveSpeculation:
    max_drafts: int
    prior_acceptance: float = 0.5  # where greedy requests start
    # where sampled requests start: lower, sampling spreads the target's mass over tokens the
    # draft ranks second or later (the demo drafts accept 10-28% of sampled drafts at T 0.8
    # where they accept 45-80% of greedy ones; docs/speculation-sampling.md)
    prior_sampled: float = 0.3
    ema: float = 0.2               # weight of each new trial in a request's acceptance
    probe_every: int = 16          # steps a request waits at least between probes
    probe_share: float = 0.03      # of the predicted step time, at most, spent on probes
    sleep_after: int | None = 8    # the rest cycle's settings: spec/drafter_rest.py
    wake_after: int = 256
    sleep_trials: int = 2
    max_wake_after: int = 1 << 14
    nap_steps: int = 64            # the longest nap (steps) that times the asleep engine
    cost: StepCostModel = field(default_factory=StepCostModel)
    realized: RealizedRates = field(default_factory=RealizedRates)
    alpha: dict[str, float] = field(default_factory=dict)
    _idle: dict[str, int] = field(default_factory=dict)
    _credit: float = 0.0           # seconds of probing earned and not yet spent
    _naps: dict[int, int] = field(default_factory=dict)   # bucket -> plan step of its last nap
    # what the last plans decided, for /metrics
    steps: int = 0
    steps_speculating: int = 0
    drafts_planned: int = 0
    last_drafts: int = 0           # drafts the last plan verifies, over all requests
    last_speculating: int = 0      # requests the last plan gave k > 0

    def __post_init__(self) -> None:
        # by kind: False greedy, True sampled
        self.shared = {False: SharedAcceptance(self.prior_acceptance),
                       True: SharedAcceptance(self.prior_sampled)}
        self._sampled: set[str] = set()    # requests that sample (temperature > 0)
        self._probing: set[str] = set()
        self.rest = DrafterRest(self)

    @property
    def dormant(self) -> bool:
        """The drafter sleeps: no capture, no proposals, no probes."""
        return self.rest.dormant

    @property
    def sleeps(self) -> int:
        return self.rest.sleeps

    def shared_alpha(self, sampled: bool = False) -> float:
        """Where a new request of that kind starts."""
        return self.shared[sampled].value

    def _start(self, request_id: str) -> float:
        return self.shared[request_id in self._sampled].value

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification: `accepted` of `drafted` drafts stood (a prefix of them)."""
        shared = self.shared[request_id in self._sampled]
        a = self.alpha.get(request_id, shared.value)
        self.rest.trials_since_wake += drafted > 0
        trials = accepted + (1 if accepted < drafted else 0)
        for i in range(trials):
            hit = i < accepted
            a += self.ema * (float(hit) - a)
            shared.add(hit)
        self.alpha[request_id] = a

    def forget(self, request_id: str) -> None:
        self.alpha.pop(request_id, None)
        self._idle.pop(request_id, None)
        self._probing.discard(request_id)
        self._sampled.discard(request_id)
        self.rest.fresh.discard(request_id)

    def plan(self, candidates: dict[str, int], base_tokens: int) -> dict[str, int]:
        """candidates: request -> drafts available (at most); base_tokens: the step's tokens
        without drafts. Returns request -> drafts to verify this step."""
        rows = len(candidates)
        if self.rest.napping:
            # the nap's verdict at its own batch size; a nap that ran out without it ends as a
            # sleep (the wake rules then apply): a drafter not shown to pay stays off
            measured = not self.realized.needs_asleep(self.rest.nap_rows)
            if measured or self.rest.nap_over:
                self.rest.end_nap(not measured
                                  or self.realized.speculation_loses(self.rest.nap_rows))
        if self.dormant:
            self.rest.slept(1)
            return self._no_drafts(candidates)
        alphas = {rid: self.alpha[rid] if rid in self.alpha else self._start(rid)
                  for rid in candidates}
        out, pays = choose_drafts(alphas, candidates, base_tokens, self.cost.coefficients(),
                                  self.max_drafts)
        bucket = max(1, rows).bit_length()
        if (any(out.values()) and self.sleep_after is not None and base_tokens == rows
                and self.realized.needs_asleep(rows)
                and self.steps - self._naps.get(bucket, -self.wake_after) >= self.wake_after):
            # once per batch size: a nap times the asleep engine's steps, the rate verifying
            # ones must beat (awake plain steps understate it 2x on the Kimi Linear demo, and
            # against them its drafts verified 16-123 blocks at 0.8-0.93x). Decode-only steps:
            # a prompt prefilled asleep would leave the draft without its context
            self.rest.nap(self.nap_steps, rows)
            self._naps[bucket] = self.steps
            return self._no_drafts(candidates)
        vetoed = self.realized.speculation_loses(rows) or self._hopeless_below(rows)
        if any(out.values()) and (not pays or vetoed or self.realized.needs_plain(rows)):
            # the verifying step's own cost is not repaid (or, a few times per batch size,
            # a plain step is timed so that the realized rates can be compared)
            out = dict.fromkeys(out, 0)
        if candidates:              # prefill-only steps say nothing about drafting
            self.rest.note_earned(any(out.values()), rows, bool(self._probing), vetoed)
        if self.dormant:            # fell asleep now: the plan it had is dropped too
            return self._no_drafts(candidates)
        # a probe spans two steps: its draft is proposed after one and verified in the next
        for rid in self._probing & candidates.keys():
            out[rid] = max(out[rid], min(candidates[rid], self.max_drafts))
            self._idle[rid] = 0
        self._probing = set()
        a, b, c, d = self.cost.coefficients()
        self._probe(out, candidates, b, c, d, a + b * base_tokens)
        self.steps += 1
        planned = sum(out.values())
        self.drafts_planned += planned
        self.steps_speculating += planned > 0
        self.last_drafts = planned
        self.last_speculating = sum(1 for k in out.values() if k)
        return out

    def _no_drafts(self, candidates: dict[str, int]) -> dict[str, int]:
        """A plan that verifies nothing (the drafter asleep, or napping from now on)."""
        self.steps += 1
        self.last_drafts = self.last_speculating = 0
        return dict.fromkeys(candidates, 0)

    def slept(self, steps: int) -> None:
        """`steps` more steps ran asleep after the one plan() saw (a multi-step decode burst,
        engine/decode_burst.py): the wake rules count steps, not plans."""
        self.rest.slept(steps)
        self.steps += steps

    def admitted(self, rows: int, request_id: str | None = None, sampled: bool = False
                 ) -> None:
        """A request was admitted (its prompt starts now) into a batch of `rows`: note its
        kind (sampled: temperature > 0), and wake the drafter if it has slept long enough,
        or the batch size moved to another bucket where the measured acceptance could pay."""
        if request_id is not None and sampled:
            self._sampled.add(request_id)
        self.rest.admitted(rows, request_id, self.steps, lambda: self._would_pay(rows, sampled),
                           lambda: (self._hopeless(rows, sampled)
                                    or self._hopeless_below(rows, sampled)))

    def _hopeless(self, rows: int, sampled: bool) -> bool:
        """Verifying steps as long as the measured ones, at the acceptance this kind of
        request has shown engine-wide, would deliver fewer tokens a second than the asleep
        engine at this batch size. A wake then buys its probes for little (the text would
        have to change a lot), and cost the Kimi Linear demo 20-25% of each 128-token
        sampled request it fell in, at 256, 512, 1024, ... steps."""
        al = self.shared_alpha(sampled)
        return self.realized.cannot_pay(rows, sum(al ** j for j in range(self.max_drafts + 1)))

    def _hopeless_below(self, rows: int, sampled: bool = False) -> bool:
        """A smaller batch size is `_hopeless`: verifying a larger batch, where each row's
        share of a plain step is smaller, would not pay either. Without this each new
        batch-size bucket learnt it again (8 verifying steps of up to 32 rows and a nap:
        the Kimi Linear demo's greedy batch-8 and batch-32 rows read 0.94-0.95 in one run)."""
        return any(self._hopeless(1 << (k - 1), sampled)
                   for k in range(1, max(1, rows).bit_length()))

    def _would_pay(self, rows: int, sampled: bool) -> bool:
        """A batch of `rows` requests at this kind's measured acceptance: would a plan draft?"""
        if self.realized.speculation_loses(rows) or self._hopeless_below(rows, sampled):
            return False
        al = self.shared_alpha(sampled)
        batch = {str(i): self.max_drafts for i in range(max(1, rows))}
        return choose_drafts(dict.fromkeys(batch, al), batch, max(1, rows),
                             self.cost.coefficients(), self.max_drafts)[1]

    def initial_drafts(self, base_tokens: int, sampled: bool = False) -> int:
        """Drafts to propose for a request that has not decoded yet (its prompt is being
        prefilled): what its kind's engine-wide acceptance earns it, charged the verifying
        step's fixed cost as if it were the only request to verify."""
        if (self.dormant or self.realized.speculation_loses(base_tokens)
                or self._hopeless_below(base_tokens, sampled)):
            return 0
        a, b, c, d = self.cost.coefficients()
        ratio = max(1.0, float(base_tokens)) / (a + b * base_tokens)
        return best_drafts(self.shared_alpha(sampled), self.max_drafts, ratio, b, c + d)

    def _probe(self, out: dict[str, int], candidates: dict[str, int], b: float, c: float,
               d: float, step_seconds: float) -> None:
        """A full block of drafts for the request idle the longest, when the budget affords
        it (or the probe is owed: DrafterRest.owed): a verifying step's fixed cost dominates a
        probe, so one draft would buy one trial where the block buys up to max_drafts (and its
        accepted tokens)."""
        self._credit = min(self._credit + self.probe_share * step_seconds, 1.0)
        rest = self.rest
        if rest.trials_since_wake >= self.sleep_trials:     # the evidence came on its own
            rest.owed = 0
        idle, unmeasured = [], []
        for rid in candidates:
            if out[rid] == 0:
                self._idle[rid] = self._idle.get(rid, 0) + 1
                if candidates[rid] > 0:
                    if self._idle[rid] >= self.probe_every:
                        idle.append(rid)
                    elif rest.owed and rid not in self.alpha:
                        unmeasured.append(rid)
            else:
                self._idle[rid] = 0
        # an owed probe goes to a request with no acceptance of its own yet (the admission
        # that woke the drafter): the others' was measured before. Once none is left (the
        # woken request's first block came) and only the owed trials keep the drafter from
        # sleeping, to a request admitted since the wake: waiting on the budget for the last
        # one kept the drafter awake (no decode bursts, states captured) for 50-140 steps of
        # every wake, which cost a batch-1 Kimi Linear demo run 10-20% (docs/benchmarks.md,
        # eighteenth session)
        owed = False
        if rest.owed:
            no_alpha = [r for r in idle + unmeasured if r not in self.alpha]
            waiting = no_alpha or ([r for r in candidates if r in rest.fresh and out[r] == 0
                                    and candidates[r] > 0] if rest.stuck else [])
            owed = bool(waiting)
            if owed:
                idle = waiting
        if not idle:
            return
        rid = max(idle, key=lambda r: self._idle[r])
        k = min(candidates[rid], self.max_drafts)
        cost = b * k + c + (0.0 if any(out.values()) else d)
        if owed:
            rest.owed -= 1
        elif self._credit >= cost:
            self._credit -= 2 * cost            # the proposal now, the verification next
        else:
            return
        out[rid], self._idle[rid] = k, 0
        self._probing.add(rid)

    def decisions(self) -> dict[str, float]:
        """What it decided, for /metrics: counters since start and the last plan's state."""
        return {"adaptive_steps": self.steps, "steps_speculating": self.steps_speculating,
                "drafts_planned": self.drafts_planned, "last_drafts": self.last_drafts,
                "last_requests_speculating": self.last_speculating,
                "enabled": 1.0 if self.last_drafts else 0.0,
                "dormant": 1.0 if self.dormant else 0.0, "sleeps": self.sleeps,
                "mean_acceptance_estimate": (sum(self.alpha.values()) / len(self.alpha)
                                             if self.alpha else self.shared_alpha())}
