"""What drafts are worth, for adaptive speculation (engine/spec/adaptive.py): the engine-wide
acceptance a new request starts from, and the number of drafts that maximises a request's
expected extra tokens less what they cost (the gain model in adaptive.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SharedAcceptance:
    """The engine-wide acceptance of one kind of decoding, where a new request's estimate
    starts: decayed hits over decayed trials, plus `weight` trials at the prior. A handful of
    verified blocks move it (the moving average it replaces, at a quarter of a request's rate,
    needed ~30 trials to close half its gap to the truth), and the decay keeps it on the
    recent text."""

    prior: float
    weight: float = 4.0
    decay: float = 0.98
    hits: float = 0.0
    trials: float = 0.0

    def add(self, hit: bool) -> None:
        self.hits = self.hits * self.decay + float(hit)
        self.trials = self.trials * self.decay + 1.0

    @property
    def value(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.trials + self.weight)


def best_drafts(alpha: float, avail: int, ratio: float, b: float, c: float) -> int:
    """The k <= avail maximising sum_{j<=k} alpha^j - ratio * (c + b*k) (0: no drafts pay),
    where ratio is the step's tokens per second, b a draft's seconds and c the first one's
    fixed cost."""
    best_k, best, gain = 0, 0.0, 0.0
    for k in range(1, avail + 1):
        gain += alpha ** k
        value = gain - ratio * (c + b * k)
        if value > best:
            best_k, best = k, value
    return best_k


def choose_drafts(alphas: dict[str, float], candidates: dict[str, int], base_tokens: int,
                  coefficients: tuple[float, float, float, float], max_drafts: int
                  ) -> tuple[dict[str, int], bool]:
    """Each request's k by the gain model (request -> drafts, from its acceptance and the drafts
    it has available), and whether the plan beats verifying nothing, the verifying step's own
    cost d included. coefficients: the step cost model's (a, b, c, d)."""
    a, b, c, d = coefficients
    plain_n = max(1.0, float(len(candidates)))
    plain_s = a + b * base_tokens
    produced, seconds = plain_n, plain_s
    out: dict[str, int] = {}
    extra_rows = 0
    for _ in range(2):                    # the ratio depends on the choices: iterate once
        ratio = produced / seconds
        out, extra_tokens, extra_rows, extra_gain = {}, 0, 0, 0.0
        for rid, avail in candidates.items():
            al = alphas[rid]
            k = best_drafts(al, min(avail, max_drafts), ratio, b, c)
            out[rid] = k
            if k:
                extra_gain += sum(al ** j for j in range(1, k + 1))
                extra_tokens += k
                extra_rows += 1
        produced = plain_n + extra_gain
        seconds = a + b * (base_tokens + extra_tokens) + c * extra_rows + (
            d if extra_rows else 0.0)
    return out, bool(extra_rows) and produced / seconds > plain_n / plain_s
