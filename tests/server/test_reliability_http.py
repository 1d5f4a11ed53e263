"""Each problem of the reliability review as a regression test over real HTTP; after each one
the server still serves normally. Fault tests: SIGSTOP of the engine, SIGTERM during streams."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from server_harness import assert_openai_error, metrics, running, start_server, wait_idle

SHORT = {"prompt": "Day", "max_tokens": 2, "ignore_eos": True}
BIG = 10 << 20          # a 10 MB prompt


@pytest.fixture(scope="module")
def rel(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "rel.log"
    srv = start_server(tiny_model_dir, log, "--max-model-len", "512", "--torch-threads", "1",
                       "--default-max-tokens", "5", "--max-num-seqs", "16")
    yield srv
    assert srv.stop() == 0
    assert 'HTTP/1.1" 5' not in srv.log()


def post(srv, body, path="/completions", **kw):
    return httpx.post(srv.base_url + path, json=body, timeout=120, **kw)


def serves(srv) -> None:
    r = post(srv, SHORT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field,value", [
    ("top_k", 9223372036854775808), ("top_k", 2**64 + 5), ("seed", 2**64), ("seed", 10**30),
    ("min_tokens", 2**70), ("stop_token_ids", [2**65]), ("max_tokens", 2**64),
])
def test_out_of_range_integers_are_400(rel, field, value):
    err = assert_openai_error(post(rel, {**SHORT, field: value}), 400)
    assert field in err["message"]
    serves(rel)


def test_uint64_seed_with_n_serves(rel):
    r = post(rel, {**SHORT, "n": 2, "seed": 18446744073709551615, "temperature": 0.9})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


@pytest.mark.parametrize("prompt", [[2**64], [[1, 2], [-(2**70)]], [300], [10**40]])
def test_prompt_token_ids_out_of_range_are_400(rel, prompt):
    assert "token ids" in assert_openai_error(post(rel, {**SHORT, "prompt": prompt}), 400)[
        "message"]
    serves(rel)


@pytest.mark.parametrize("path,body", [
    ("/completions", {**SHORT, "prompt": "a\ud800b"}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x\udfffy"}],
                           "max_tokens": 2}),
    ("/tokenize", {"prompt": "a\ud800b"}),
])
def test_lone_surrogates_are_400(rel, path, body):
    url = rel.url + path if path == "/tokenize" else rel.base_url + path
    r = httpx.post(url, content=json.dumps(body), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert "Unicode" in assert_openai_error(r, 400)["message"]
    serves(rel)


def test_huge_prompts_are_refused_while_health_answers(rel):
    """10 MB prompts (completions, chat, /tokenize) get their 400 without tokenizing, and
    /health keeps answering meanwhile."""
    big = "word " * (BIG // 5)

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as c:
            posts = [c.post(rel.base_url + "/completions", json={**SHORT, "prompt": big}),
                     c.post(rel.base_url + "/chat/completions", json={
                         "messages": [{"role": "user", "content": big}], "max_tokens": 2}),
                     c.post(rel.url + "/tokenize", json={"prompt": big})]
            tasks = [asyncio.ensure_future(p) for p in posts]
            health = []
            while not all(t.done() for t in tasks):
                health.append((await c.get(rel.url + "/health")).status_code)
                await asyncio.sleep(0.05)
            return [t.result() for t in tasks], health

    results, health = asyncio.run(scenario())
    for r in results:
        assert_openai_error(r, 400, "context_length_exceeded")
    assert all(code == 200 for code in health)
    serves(rel)


def test_too_many_sequences_is_400(rel):
    r = post(rel, {**SHORT, "prompt": ["x"] * 250, "n": 128})
    assert_openai_error(r, 400, "too_many_sequences")
    serves(rel)


def test_stop_string_caps(rel):
    assert "at most 64" in assert_openai_error(
        post(rel, {**SHORT, "stop": [f"s{i}" for i in range(10_000)]}), 400)["message"]
    assert "characters" in assert_openai_error(
        post(rel, {**SHORT, "stop": ["z" * 5000]}), 400)["message"]
    r = post(rel, {**SHORT, "stop": [f"never{i}" for i in range(64)], "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_vanishing_temperature_is_greedy(rel):
    body = {"prompt": "The night", "max_tokens": 6, "ignore_eos": True}
    tiny = post(rel, {**body, "temperature": 1e-45}).json()["choices"][0]
    greedy = post(rel, {**body, "temperature": 0}).json()["choices"][0]
    assert tiny["text"] == greedy["text"] and tiny["finish_reason"] == "length"


def test_chat_without_max_tokens_gets_the_default(rel):
    r = post(rel, {"messages": [{"role": "user", "content": "hello"}], "ignore_eos": True},
             "/chat/completions")
    assert r.json()["usage"]["completion_tokens"] == 5       # --default-max-tokens 5


def test_heavy_request_does_not_starve_a_short_one(rel):
    """n=16 sequences of 480 tokens take every slot; a 2-token request sent after it still
    finishes long before the heavy one (fair-share admission)."""
    heavy_body = {"prompt": "ROMEO:", "n": 16, "max_tokens": 480, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=rel.base_url, timeout=300) as c:
            heavy = asyncio.ensure_future(c.post("/completions", json=heavy_body))
            # the short request goes in once the heavy one holds the slots (a fixed sleep
            # was longer than the whole heavy request once decoding got fast)
            deadline = time.monotonic() + 60
            while (await asyncio.to_thread(metrics, rel.url))[
                    "kdaserve:num_requests_running"] < 16:
                assert not heavy.done() and time.monotonic() < deadline
                await asyncio.sleep(0.01)
            short = await c.post("/completions", json=SHORT)
            return short, heavy.done(), await heavy

    short, heavy_done_first, heavy = asyncio.run(scenario())
    assert short.status_code == 200 and not heavy_done_first
    assert heavy.status_code == 200 and len(heavy.json()["choices"]) == 16
    wait_idle(rel.url)


def test_metrics_need_the_key_unless_public(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, tmp_path / "k.log", "--torch-threads", "1",
                       env={"KDASERVE_API_KEY": "k3y"})
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        assert_openai_error(httpx.get(srv.url + "/metrics"), 401, "invalid_api_key")
        r = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and "kdaserve:engine_up 1" in r.text
    finally:
        assert srv.stop() == 0


def test_stalled_engine_is_unhealthy_and_requests_time_out(tiny_model_dir, tmp_path):
    """SIGSTOP of the engine: /health turns 503 within --health-timeout, a request ends with
    504 at --request-timeout; after SIGCONT everything is back."""
    srv = start_server(tiny_model_dir, tmp_path / "stall.log", "--torch-threads", "1",
                       "--health-timeout", "1.5", "--request-timeout", "3")
    engine = srv.engine_pid()
    try:
        serves(srv)
        os.kill(engine, signal.SIGSTOP)
        deadline = time.monotonic() + 15
        while httpx.get(srv.url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 with a stopped engine"
            time.sleep(0.1)
        assert_openai_error(httpx.get(srv.url + "/health"), 503, "engine_stalled")
        assert_openai_error(post(srv, SHORT), 504, "request_timeout")
        os.kill(engine, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "/health did not recover"
            time.sleep(0.1)
        serves(srv)
        wait_idle(srv.url)
    finally:
        os.kill(engine, signal.SIGCONT)
        assert srv.stop() == 0


def test_sigterm_drains_streams(tiny_model_dir, tmp_path):
    """SIGTERM to the server's process group (as a service manager sends it; the engine
    ignores it and is stopped by the server): a short stream finishes normally with its usage,
    new requests get 503 with Retry-After, a long stream is ended with a shutting_down error
    event after --shutdown-timeout, the server exits 0, its engine is gone and its log has no
    error."""
    # the long stream must outlast the timeout however fast decoding gets: 60k tokens
    srv = start_server(tiny_model_dir, tmp_path / "drain.log", "--torch-threads", "1",
                       "--shutdown-timeout", "3", "--max-model-len", "65536")
    engine = srv.engine_pid()
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    model = client.models.list().data[0].id

    async def stream(c, max_tokens):
        events = []
        async with c.stream("POST", "/completions", json={
                "model": model, "prompt": "The night", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        started.set()
        return events

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as c:
            long = asyncio.ensure_future(stream(c, 60000))
            await started.wait()
            short = asyncio.ensure_future(stream(c, 40))
            await asyncio.sleep(0.3)
            os.killpg(srv.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.5)
            refused = await c.post("/completions", json={**SHORT, "model": model})
            return await long, await short, refused

    started = asyncio.Event()
    try:
        long_events, short_events, refused = asyncio.run(scenario())
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
    assert_openai_error(refused, 503, "shutting_down")
    assert refused.headers["retry-after"] == "1"
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["usage"]["completion_tokens"] == 40
    assert json.loads(short_events[-3])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    assert json.loads(long_events[-2])["error"]["code"] == "shutting_down"
    assert not running(engine)
    assert "ERROR" not in srv.log()
    assert "Traceback" not in srv.log()
