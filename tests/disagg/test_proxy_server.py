"""Disaggregated serving with real processes on loopback: a prefill instance, two decode
instances (other block sizes than the prefill's) and `kdaserve proxy`, driven with the
official `openai` client.

- Greedy output through the proxy equals colocated output (the decode instance serving the
  request whole), token for token, over prompts of several lengths, streaming and not, chat too;
  and on a chat's second turn that hits the decode instance's prefix cache (the hit query: the
  latents it holds do not travel).
- Faults, each bounded in time: a decode instance that stops acknowledging mid-transfer (its
  engine frozen) makes the proxy start over on another one, or gives a clear 503 when there is
  none; a prefill instance that never answers gives a 504; a decode instance that is gone is
  passed over for another.
- Afterwards no instance holds a page, a slot or an arrived cache (/metrics).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from server_harness import REPO, Server, free_port, metrics, wait_idle

from kdaserve.disagg.backends import parse_load

COMMON = ("--max-model-len", "512", "--cache-memory", "16MiB", "--torch-threads", "1",
          "--log-level", "info", "--max-num-seqs", "4", "--served-model-name", "model")
KV = ("--kv-transfer-timeout", "2", "--kv-transfer-ttl", "3")
WORDS = "the king and the queen of the night sun moon star crown love light old".split()


def _spawn(cmd: list[str], log_path, port: int) -> Server:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
    return Server(proc, port, log_path)


def _serve(model, logs, name, *args) -> Server:
    port = free_port()
    return _spawn([sys.executable, "-m", "kdaserve.cli", "serve", "--model", str(model),
                   "--port", str(port), *COMMON, *args], logs / f"{name}.log", port)


def _proxy(logs, name, prefill: list[Server], decode: list[Server], *args) -> Server:
    port = free_port()
    return _spawn([sys.executable, "-m", "kdaserve.cli", "proxy", "--port", str(port),
                   "--prefill", *[s.url for s in prefill], "--decode", *[s.url for s in decode],
                   *args], logs / f"{name}.log", port)


def _wait_healthy(servers: list[Server], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    for s in servers:
        while True:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.log_path.name} exited:\n{s.log()}")
            try:
                if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{s.log_path.name} not healthy:\n{s.log()}")
            time.sleep(0.2)


@contextmanager
def healthy(procs: list[Server]):
    """Every process answering /health for the block; then all stopped at once (each drains
    on its own)."""
    try:
        _wait_healthy(procs)
        yield
    finally:
        for s in procs:
            if s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGTERM)
        for s in procs:
            s.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg_logs")
    p = _serve(tiny_model_dir, logs, "prefill", "--block-size", "4", "--role", "prefill", *KV)
    # a frozen engine shows in its /metrics after 2 s (no engine gauges: it looks idle)
    d1 = _serve(tiny_model_dir, logs, "decode1", "--block-size", "8", "--role", "decode",
                "--kv-transfer-port", str(free_port()), "--health-timeout", "2", *KV)
    d2 = _serve(tiny_model_dir, logs, "decode2", "--block-size", "16", "--role", "decode",
                "--kv-transfer-port", str(free_port()), *KV)
    # a generous probe timeout: on a busy machine a slow answer must not rank d1 last
    front = _proxy(logs, "proxy", [p], [d1, d2], "--probe-timeout", "10")
    lone = _proxy(logs, "proxy_lone", [p], [d1], "--prefill-timeout", "3")
    # a chat's turns reach the same decode instance through it (its prefix cache hits)
    turns = _proxy(logs, "proxy_turns", [p], [d1], "--hit-query-timeout", "30")
    with healthy([p, d1, d2, front, lone, turns]):
        yield p, d1, d2, front, lone, turns


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def complete(c: openai.OpenAI, prompt: str, stream: bool = False, max_tokens: int = 8):
    kw = dict(model="model", prompt=prompt, max_tokens=max_tokens, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    if stream:
        return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw)
                       if ch.choices), None
    r = c.completions.create(**kw)
    return r.choices[0].text, (r.choices[0].model_extra["token_ids"], r.usage)


def test_greedy_output_equals_colocated(cluster):
    p, d1, d2, front, *_ = cluster
    colocated, proxied = client(d1), client(front)
    # the proxy lists the decode instances' model as they do
    assert [m.id for m in proxied.models.list().data] == [
        m.id for m in colocated.models.list().data]
    prompts = [" ".join(WORDS[: n]) for n in (1, 3, 6, 10, 15)] + [" ".join(WORDS * 4)]
    for i, prompt in enumerate(prompts):
        want = complete(colocated, prompt)
        assert complete(proxied, prompt) == want, prompt
        if i % 2:
            assert complete(proxied, prompt, stream=True)[0] == want[0]
    chat = dict(model="model", messages=[{"role": "user", "content": "the old king"}],
                max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = colocated.chat.completions.create(**chat).choices[0].message.content
    got = "".join(ch.choices[0].delta.content or "" for ch in
                  proxied.chat.completions.create(stream=True, **chat) if ch.choices)
    assert got == want
    sent = metrics(p.url)
    assert sent["kdaserve:kv_transfer_sent_total"] >= len(prompts) + 1
    assert sent["kdaserve:kv_transfer_sent_mla_bytes_total"] > 0
    assert sent["kdaserve:kv_transfer_sent_kda_bytes_total"] > 0
    taken = sum(metrics(d.url)["kdaserve:kv_transfer_taken_total"] for d in (d1, d2))
    assert taken == sent["kdaserve:kv_transfer_sent_total"]


def test_second_turn_sends_only_what_the_decode_instance_lacks(cluster):
    """A chat's second turn (the first prompt, its answer, more) through the proxy: the
    decode instance (blocks of 8; the prefill instance's are 4) holds the first 40 tokens (up
    to the snapshot it took while decoding the answer), says so to the hit query, and the
    prefill instance sends only the rest. The output equals colocated (another decode
    instance serving the request whole), and the latents moved drop by the held tokens'."""
    p, d1, d2, *_, turns = cluster
    ref, proxied = client(d2), client(turns)
    g = random.Random(7)
    first = [g.randrange(3, 250) for _ in range(37)]
    mla = "kdaserve:kv_transfer_sent_mla_bytes_total"
    hits = "kdaserve:prefix_cache_hit_tokens_total"
    before = metrics(p.url)[mla]
    want1 = complete(ref, first)
    assert complete(proxied, first) == want1
    per_token = (metrics(p.url)[mla] - before) / len(first)
    second = first + want1[1][0] + [g.randrange(3, 250) for _ in range(7)]
    want2 = complete(ref, second)
    p0, d0 = metrics(p.url), metrics(d1.url)
    assert complete(proxied, second) == want2
    p1, d1m = metrics(p.url), metrics(d1.url)
    held = d1m[hits] - d0[hits]
    moved = p1[mla] - p0[mla]
    assert held == 40
    assert 0 < moved < per_token * len(second)
    assert moved == per_token * (len(second) - held)
    assert p1["kdaserve:kv_transfer_sent_kda_bytes_total"] > p0[
        "kdaserve:kv_transfer_sent_kda_bytes_total"]


def _freeze(server: Server):
    """The server's engine process stops (its kv receiver with it); HTTP still answers."""
    pid = server.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    return lambda: os.kill(pid, signal.SIGCONT)


def test_decode_gone_mid_transfer_is_a_clear_503(cluster):
    _, d1, _, _, lone, _ = cluster
    thaw = _freeze(d1)
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            complete(client(lone), "the king and the queen")
        assert err.value.status_code == 503
        assert err.value.body["code"] == "no_decode_instance"
        assert "did not acknowledge" in err.value.body["message"]
        assert time.monotonic() - start < 30
    finally:
        thaw()


def test_decode_gone_mid_transfer_retries_on_another(cluster):
    """The proxy picks the frozen decode instance (its /metrics shows no load), the prefill
    instance's push is not acknowledged, and the request starts over on the other one."""
    _, d1, d2, front, *_ = cluster
    want = complete(client(d2), "the crown of the old king")
    retries = metrics(front.url)["kdaserve_proxy_retries_total"]
    thaw = _freeze(d1)
    try:
        time.sleep(2.5)                       # past d1's --health-timeout
        got = complete(client(front), "the crown of the old king")
        after = metrics(front.url)["kdaserve_proxy_retries_total"]
        assert (got, after) == (want, retries + 1), front.log()[-3000:]
    finally:
        thaw()


def test_prefill_that_never_answers_times_out(cluster):
    p, *_, lone, _ = cluster
    thaw = _freeze(p)
    try:
        with pytest.raises(openai.APIStatusError) as err:
            complete(client(lone), "the queen of the night")
        assert err.value.status_code == 504
        assert err.value.body["code"] == "prefill_timeout"
    finally:
        thaw()


def test_no_pages_or_caches_left_behind(cluster):
    p, d1, d2, *_ = cluster
    for s in (p, d1, d2):
        wait_idle(s.url, timeout=60)
    deadline = time.monotonic() + 30          # arrived caches nobody took expire (ttl 3 s)
    for d in (d1, d2):
        while metrics(d.url)["kdaserve:kv_transfer_pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        m = metrics(d.url)
        assert m["kdaserve:kv_transfer_pending"] == m["kdaserve:kv_transfer_pending_bytes"] == 0
        assert m["kdaserve:cache_all_free"] == 1.0
    assert parse_load(httpx.get(p.url + "/metrics").text) == 0


def test_a_dead_decode_instance_is_passed_over(cluster):
    _, d1, d2, front, *_ = cluster
    want = complete(client(d2), "the sun and the moon")
    d1.stop()
    assert complete(client(front), "the sun and the moon") == want
