"""The proxy's instances: their load (read from each one's /metrics), their kv-transfer
address (a decode instance's /kv_transfer), and the order to try them in.

Least loaded = fewest requests running + waiting (the engine's own gauges). An instance whose
/metrics does not answer within `probe_timeout_s` is left out of that choice; one that failed
a request is tried last for `penalty_s`, so a dead decode instance stops drawing requests.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

_LOAD_GAUGES = ("kdaserve:num_requests_running", "kdaserve:num_requests_waiting")


def parse_load(metrics_text: str) -> float:
    """Requests running + waiting, from a Prometheus text page."""
    total = 0.0
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in _LOAD_GAUGES:
            total += float(value)
    return total


@dataclass
class Backend:
    url: str
    failed_at: float = -1e9
    kv_address: str | None = None


class BackendPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient,
                 probe_timeout_s: float = 1.0, penalty_s: float = 10.0) -> None:
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.client = client
        self.probe_timeout_s = probe_timeout_s
        self.penalty_s = penalty_s

    async def _load(self, b: Backend) -> float | None:
        try:
            r = await self.client.get(f"{b.url}/metrics", timeout=self.probe_timeout_s)
            r.raise_for_status()
            return parse_load(r.text)
        except (httpx.HTTPError, ValueError):
            return None

    async def ranked(self) -> list[Backend]:
        """Every instance, best first: reachable before unreachable, not recently failed before
        recently failed, then least loaded."""
        loads = await asyncio.gather(*(self._load(b) for b in self.backends))
        now = time.monotonic()

        def key(i: int) -> tuple:
            b, load = self.backends[i], loads[i]
            return (load is None, now - b.failed_at < self.penalty_s,
                    load if load is not None else 0.0, i)

        return [self.backends[i] for i in sorted(range(len(self.backends)), key=key)]

    def failed(self, b: Backend) -> None:
        b.failed_at = time.monotonic()
        b.kv_address = None

    async def kv_address(self, b: Backend, headers: dict[str, str]) -> str:
        """Where a decode instance receives caches (asked once, again after a failure)."""
        if b.kv_address is None:
            r = await self.client.get(f"{b.url}/kv_transfer", headers=headers,
                                      timeout=self.probe_timeout_s)
            r.raise_for_status()
            info = r.json()
            if info.get("role") != "decode" or not info.get("address"):
                raise ValueError(f"{b.url} is not a decode instance (serve --role decode "
                                 f"--kv-transfer-port P); it says {info}")
            b.kv_address = info["address"]
        return b.kv_address
