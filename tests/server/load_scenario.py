"""The load scenario of the reliability work: many concurrent streaming clients with random
lengths and random disconnects, plus a few hostile ones, against a live server.

Run alone for the figures in docs/reliability.md:
    python tests/server/load_scenario.py [--clients 200] [--seconds 60]
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = "the night is long and the day is bright over the hills of verona".split()


@dataclass
class LoadReport:
    completed: int = 0
    aborted: int = 0                      # disconnected on purpose mid-stream
    statuses: Counter = field(default_factory=Counter)
    hostile: Counter = field(default_factory=Counter)
    hostile_by_kind: dict[str, Counter] = field(default_factory=dict)   # kind -> statuses
    ttft: list[float] = field(default_factory=list)
    stream_errors: Counter = field(default_factory=Counter)
    transport_errors: Counter = field(default_factory=Counter)

    @property
    def p99_ttft(self) -> float:
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

    def to_dict(self) -> dict:
        xs = sorted(self.ttft)
        return {"completed": self.completed, "aborted": self.aborted,
                "status_counts": dict(self.statuses), "hostile_status_counts": dict(self.hostile),
                "hostile_by_kind": {k: dict(v) for k, v in self.hostile_by_kind.items()},
                "stream_error_codes": dict(self.stream_errors), "normal_requests": len(xs),
                "transport_errors": dict(self.transport_errors),
                "ttft_p50_s": round(xs[len(xs) // 2], 3) if xs else None,
                "ttft_p99_s": round(self.p99_ttft, 3) if xs else None,
                "server_5xx": sum(v for k, v in self.statuses.items() if k >= 500)
                + sum(v for k, v in self.hostile.items() if k >= 500)}


async def _normal(c: httpx.AsyncClient, rng: random.Random, rep: LoadReport, model: str,
                  stop_at: float) -> None:
    while time.monotonic() < stop_at:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, 64),
                "stream": True, "ignore_eos": True,
                "temperature": rng.choice([0.0, 0.8])}
        leave_after = rng.randint(1, 8) if rng.random() < 0.3 else None
        t0 = time.monotonic()
        try:
            async with c.stream("POST", "/completions", json=body) as r:
                rep.statuses[r.status_code] += 1
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0.2)          # a 503 asks to come back later
                    continue
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        rep.stream_errors[event["error"].get("code")] += 1
                        break
                    if chunks == 0:
                        rep.ttft.append(time.monotonic() - t0)
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        break
                if leave_after is not None and chunks >= leave_after:
                    rep.aborted += 1
                else:
                    rep.completed += 1
        except httpx.HTTPError as exc:
            rep.transport_errors[type(exc).__name__] += 1


# What each hostile request must get: n=128 is the most allowed, so it runs; the others break
# a limit (64 stop strings, the context's bytes, top_k in int32) and are refused.
HOSTILE_STATUS = {"n=128": 200, "10,000 stops": 400, "10 MB prompt": 400, "top_k 2**63": 400}


def _hostile_bodies(model: str) -> dict[str, dict]:
    big = "word " * (2 << 20)                 # 10 MB
    return {
        "n=128": {"model": model, "prompt": "ROMEO:", "n": 128, "max_tokens": 200,
                  "ignore_eos": True},
        "10,000 stops": {"model": model, "prompt": "x", "max_tokens": 4,
                         "stop": [f"s{i}" for i in range(10_000)]},
        "10 MB prompt": {"model": model, "prompt": big, "max_tokens": 4},
        "top_k 2**63": {"model": model, "prompt": "hi", "max_tokens": 1,
                        "top_k": 9223372036854775808},
    }


async def _hostile(c: httpx.AsyncClient, rng: random.Random, rep: LoadReport, model: str,
                   stop_at: float, first: int) -> None:
    bodies = list(_hostile_bodies(model).items())
    # each client starts at another kind, then picks at random: every kind is sent at once
    kind, body = bodies[first % len(bodies)]
    while time.monotonic() < stop_at:
        try:
            r = await c.post("/completions", json=body)
            rep.hostile[r.status_code] += 1
            rep.hostile_by_kind.setdefault(kind, Counter())[r.status_code] += 1
        except httpx.HTTPError as exc:
            rep.transport_errors[type(exc).__name__] += 1
        await asyncio.sleep(rng.uniform(0.5, 3.0))
        kind, body = rng.choice(bodies)


async def run_load(base_url: str, clients: int = 200, seconds: float = 60.0,
                   hostile: int = 4, seed: int = 0) -> LoadReport:
    rep = LoadReport()
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=clients + hostile + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as c:
        model = (await c.get("/models")).json()["data"][0]["id"]
        stop_at = time.monotonic() + seconds
        tasks = [_normal(c, random.Random(rng.random()), rep, model, stop_at)
                 for _ in range(clients)]
        tasks += [_hostile(c, random.Random(rng.random()), rep, model, stop_at, i)
                  for i in range(hostile)]
        await asyncio.gather(*tasks)
    return rep


if __name__ == "__main__":     # pragma: no cover - a tool for the docs' figures
    import argparse
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from server_harness import build_tiny_model, start_server, wait_idle

    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    d = Path(tempfile.mkdtemp())
    srv = start_server(build_tiny_model(d), d / "server.log", "--torch-threads", "1")
    try:
        report = asyncio.run(run_load(srv.base_url, args.clients, args.seconds))
        idle = wait_idle(srv.url)
        print(json.dumps({**report.to_dict(), "cache_all_free": idle["kdaserve:cache_all_free"]},
                         indent=2))
    finally:
        srv.stop()
