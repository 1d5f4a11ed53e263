"""How many of this machine's cores the engine's forward should use while other processes use
some: the served engine's threads follow the cores left to it.

The forward splits each product and attention over its threads and waits for all of them at
the end of each one (an OpenMP team). When another process takes one of those cores, the
scheduler runs that core's thread half the time or less, and every other thread waits for it
at each of the thousands of joins a step has: measured on 2 cores with one busy loop beside
the engine (the K3 demo), 4 echo prompts of 1,000 tokens took 2.4-2.9 s on two threads
against 1.0 s on one (0.65 s with both cores free), 64 decode tokens 0.27 s against 0.12.
So every `interval` seconds the engine process reads how much CPU the machine's other
processes used on its cores (/proc/stat less this process's own time) and runs with the
cores they left, at least one, at most what it was configured with. The HTTP front end is
one of those processes: while it works for more than half a core, the engine leaves it one.

The products give the same bits on any number of threads (ops/csrc: each output sums in the
same order whatever the split), so a change of threads changes no token. Linux only (reads
/proc); elsewhere, and where /proc cannot be read, the configured count stays.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

logger = logging.getLogger("kdaserve")

_IDLE_FIELDS = (3, 4)            # idle, iowait in a /proc/stat cpu line's counters
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100    # ticks a second


def _busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the given CPUs spent busy since boot, all processes together."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        counts = [int(v) for v in rest.split()[:8]]
        busy += sum(v for i, v in enumerate(counts) if i not in _IDLE_FIELDS)
    return busy


def _own_ticks() -> int | None:
    """Clock ticks this process (all its threads) spent on CPU since it started."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])          # utime, stime


@dataclass
class CpuShare:
    """`configured`: the engine's thread count; `threads()` the count to run with now."""

    configured: int
    interval: float = 0.5
    cpus: set[int] = field(default_factory=lambda: set(os.sched_getaffinity(0))
                           if hasattr(os, "sched_getaffinity") else set())
    others: float = 0.0            # cores the other processes used over the last interval
    _last: tuple[float, int, int] | None = None
    _threads: int = 0

    def __post_init__(self) -> None:
        self._threads = self.configured

    def threads(self, now: float | None = None) -> int:
        """The thread count for the next steps (read at most every `interval` seconds)."""
        now = time.monotonic() if now is None else now
        if self.configured <= 1 or not self.cpus:
            return self.configured
        if self._last is not None and now - self._last[0] < self.interval:
            return self._threads
        busy, own = _busy_ticks(self.cpus), _own_ticks()
        if busy is None or own is None:
            return self._threads
        if self._last is not None:
            seconds = now - self._last[0]
            self.others = max(0.0, (busy - self._last[1]) - (own - self._last[2])) \
                / _HZ / seconds
            self._threads = self.decide(self.others)
        self._last = (now, busy, own)
        return self._threads

    def decide(self, others: float) -> int:
        """The cores left by others' use, rounded to the nearest, within [1, configured]."""
        left = int(len(self.cpus) - others + 0.5)
        threads = max(1, min(self.configured, left))
        if threads != self._threads:
            logger.info("other processes used %.1f of %d cores: the engine runs %d "
                        "thread(s) (configured %d)", others, len(self.cpus), threads,
                        self.configured)
        return threads
