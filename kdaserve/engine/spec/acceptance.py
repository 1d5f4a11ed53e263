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
