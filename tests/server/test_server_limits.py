"""API key, the waiting-queue bound, and a dying engine, each on a server of its own (draining
open streams at SIGTERM: test_reliability_http.test_sigterm_drains_streams)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_harness import (
    assert_openai_error,
    metrics,
    parse_metrics,
    running,
    start_server,
    wait_idle,
)

KEY = "sesame-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "The night is long", "max_tokens": 1500, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "Day", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    """One sequence at a time, one waiting request at most, and an API key."""
    log = tmp_path_factory.mktemp("logs") / "guarded.log"
    srv = start_server(tiny_model_dir, log, "--max-num-seqs", "1", "--max-waiting", "1",
                       "--public-metrics",
                       "--cache-memory", "32MiB", env={"KDASERVE_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/tokenize"), ("GET", "/v1/unknown")])
def test_missing_or_wrong_key_is_401(guarded, headers, method, path):
    r = httpx.request(method, guarded.url + path, headers=headers, json=SHORT)
    err = assert_openai_error(r, 401, "invalid_api_key")
    assert err["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_stay_open(guarded):
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert metrics(guarded.url)["kdaserve:engine_up"] == 1


def test_right_key_serves(guarded):
    with openai.OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0) as client:
        resp = client.completions.create(model=client.models.list().data[0].id, prompt="Day",
                                         max_tokens=2, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 2
    with openai.OpenAI(base_url=guarded.base_url, api_key="nope", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_queue_over_bound_is_503(guarded):
    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded.base_url, headers=AUTH,
                                     timeout=60) as c:
            async with c.stream("POST", "/completions", json=LONG) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()   # keep a reference: a dropped one hangs up
                while not (await lines.__anext__()).startswith("data: {"):
                    pass                        # A now holds the only sequence
                queued = asyncio.create_task(c.post("/completions", json=SHORT))
                deadline = time.monotonic() + 30
                while parse_metrics((await c.get(guarded.url + "/metrics")).text)[
                        "kdaserve:num_requests_waiting"] != 1:
                    assert time.monotonic() < deadline, "B never queued"
                    await asyncio.sleep(0.02)
                refused = await c.post("/completions", json=SHORT)
            # closing A aborts it, so B runs
            return refused, await queued

    refused, queued = asyncio.run(scenario())
    assert_openai_error(refused, 503, "queue_full")
    assert refused.headers["retry-after"] == "1"
    assert queued.status_code == 200
    assert queued.json()["usage"]["completion_tokens"] == 2
    wait_idle(guarded.url)
    r = httpx.post(guarded.base_url + "/completions", json=SHORT, headers=AUTH, timeout=60)
    assert r.status_code == 200


def test_engine_death_fails_requests_and_exits_nonzero(tiny_model_dir, tmp_path):
    """kill -9 of the engine core: the stream in flight ends with an engine_dead error event,
    and the server exits with code 1 (for its supervisor to restart it) within seconds."""
    srv = start_server(tiny_model_dir, tmp_path / "doomed.log", "--cache-memory", "32MiB")
    try:
        with httpx.stream("POST", srv.base_url + "/completions", json=LONG, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            os.kill(srv.engine_pid(), signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        errors = [json.loads(line[6:])["error"] for line in rest[:-1]
                  if "error" in json.loads(line[6:])]
        assert [e["code"] for e in errors] == ["engine_dead"]
        assert srv.proc.wait(timeout=20) == 1
        assert "the engine died" in srv.log()
    finally:
        srv.stop()


def test_engine_exits_when_server_is_killed(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, tmp_path / "orphan.log", "--cache-memory", "32MiB")
    engine = srv.engine_pid()
    srv.proc.kill()
    srv.proc.wait()
    deadline = time.monotonic() + 30
    while running(engine):
        assert time.monotonic() < deadline, "the engine outlived its server"
        time.sleep(0.1)
