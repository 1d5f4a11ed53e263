"""The load test (bounded, 20 s of load): 200 concurrent streaming clients with random lengths
and random disconnects, and hostile requests (n=128, 10,000 stop strings, 10 MB prompts, out-
of-range integers). Zero 5xx, zero leaked pages, and the normal requests' p99 time to first
token under 30 s (2 cores, the tiny model, one torch thread; about 12 s measured on an idle
machine, 20 s with other jobs running: docs/reliability.md).

20 s, not the 60 s of docs/reliability.md's figures: the 200 clients fill the 64 sequence
slots within the first second, so every second after that repeats the same saturated state;
20 s still completes ~500 requests and aborts ~180 (the figures' rates), and every hostile
kind is sent at the start whatever the length."""

from __future__ import annotations

import asyncio
import json

import pytest
from load_scenario import HOSTILE_STATUS, run_load
from server_harness import start_server, wait_idle

P99_TTFT_BOUND_S = 30.0
LOAD_S = 20.0


@pytest.mark.slow
def test_load_with_hostile_clients(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, tmp_path / "load.log", "--torch-threads", "1")
    try:
        report = asyncio.run(run_load(srv.base_url, clients=200, seconds=LOAD_S))
        idle = wait_idle(srv.url, timeout=120)
        summary = report.to_dict()
        print(json.dumps(summary))
        assert summary["server_5xx"] == 0, summary
        assert not report.stream_errors, summary
        assert idle["kdaserve:cache_all_free"] == 1.0
        assert report.completed > 200 and report.aborted > 20
        # every kind of hostile request was sent, and each got the answer it must get
        assert {k: set(v) for k, v in report.hostile_by_kind.items()} == \
            {k: {status} for k, status in HOSTILE_STATUS.items()}, summary
        assert report.p99_ttft < P99_TTFT_BOUND_S, summary
    finally:
        assert srv.stop() == 0
