"""Issue 35: a torchrun rank killed while the server is idle makes /health 503 within
--health-timeout. The other ranks are not the engine's children: rank 0 pings them every
heartbeat. The ranks are started the way torchrun starts them (its environment), without
its agent, so that rank 0's own check is what notices (the agent would end rank 0 too)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
from server_harness import REPO, free_port, health_after, start_server

from kdaserve.assets import KIMI_LINEAR_DEMO_DIR

ARGS = ("--torch-threads", "1", "--distributed-executor", "torchrun",
        "--tensor-parallel-size", "2", "--cache-memory", "64MiB", "--max-model-len", "256",
        "--health-timeout", "5")


def _rank_env(rank: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def test_a_torchrun_rank_killed_while_idle_makes_health_503(tmp_path):
    port = free_port()
    with open(tmp_path / "rank1.log", "wb") as log1:
        rank1 = subprocess.Popen(
            [sys.executable, "-m", "kdaserve.server.cli", "--model", str(KIMI_LINEAR_DEMO_DIR),
             "--port", str(free_port()), *ARGS], cwd=REPO, stdout=log1,
            stderr=subprocess.STDOUT, env={**os.environ, **_rank_env(1, port)})
    srv = None
    try:
        srv = start_server(KIMI_LINEAR_DEMO_DIR, tmp_path / "server.log", *ARGS,
                           env=_rank_env(0, port))
        r = httpx.post(srv.base_url + "/completions", timeout=120,
                       json={"prompt": "Day", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
        time.sleep(1.0)                             # idle, pinged a few times: still fine
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        rank1.kill()                                # idle: no request in flight
        rank1.wait(timeout=30)
        status = health_after(srv.url, 60)          # generous: --health-timeout is 5 s
        assert status != 200, "a dead torchrun rank went unnoticed while idle"
    finally:
        if srv is not None:
            srv.stop()
        if rank1.poll() is None:
            rank1.kill()
        rank1.wait(timeout=10)
    assert "worker died while the engine was idle" in srv.log()
