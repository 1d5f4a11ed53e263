"""Issue 35: with --tensor-parallel-size 2, a rank killed while the server is idle makes
/health 503 within --health-timeout (the engine checks its workers between requests too), and
the engine ends the other rank and exits, so the server exits with code 1."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from server_harness import health_after, running, start_server

from kdaserve.assets import KIMI_LINEAR_DEMO_DIR


def _workers(engine_pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == engine_pid and b"spawn_main" in cmdline and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_a_rank_killed_while_idle_makes_health_503(tmp_path):
    srv = start_server(KIMI_LINEAR_DEMO_DIR, tmp_path / "server.log", "--torch-threads", "1",
                       "--tensor-parallel-size", "2", "--cache-memory", "64MiB",
                       "--max-model-len", "256", "--health-timeout", "5")
    try:
        r = httpx.post(srv.base_url + "/completions", timeout=120,
                       json={"prompt": "Day", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
        workers = _workers(srv.engine_pid())
        assert workers, "no worker processes"
        os.kill(workers[-1], signal.SIGKILL)        # idle: no request in flight
        status = health_after(srv.url, 60)          # generous: --health-timeout is 5 s
        assert status != 200, "a dead rank went unnoticed while idle"
        # the engine stops the other rank and exits; the server exits 1 for its supervisor
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()
    assert "worker died while the engine was idle" in srv.log()
    assert not [w for w in workers if running(w)]
