"""Tensor-parallel instances behind the real proxy, as processes on loopback, driven with the
official `openai` client: a TP=2 prefill instance (two gloo workers, one KDA head each)
feeds a TP=1 decode instance through one proxy and a TP=2 decode instance through another.
Greedy output, streamed or not, equals colocated output (the TP=1 decode instance serving
the request whole) token for token; the prefill ranks' bytes all arrive and are taken; no
instance keeps a page, a slot or an arrived cache (/metrics).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from server_harness import build_tiny_model, free_port, metrics, wait_idle
from test_proxy_server import KV, WORDS, _proxy, _serve, _wait_healthy, client, complete

# three servers, two of them with two worker ranks, and two proxies
pytestmark = pytest.mark.slow

TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # two MLA heads and two KDA heads: each rank gets one of each
    model = build_tiny_model(tmp_path_factory.mktemp("tp_model"), num_attention_heads=2)
    logs = tmp_path_factory.mktemp("disagg_tp_logs")
    p = _serve(model, logs, "prefill_tp2", "--block-size", "4", "--role", "prefill", *TP2, *KV)
    d1 = _serve(model, logs, "decode_tp1", "--block-size", "8", "--role", "decode",
                "--kv-transfer-port", str(free_port()), *KV)
    d2 = _serve(model, logs, "decode_tp2", "--block-size", "16", "--role", "decode",
                "--kv-transfer-port", str(free_port()), *TP2, *KV)
    to_d1 = _proxy(logs, "proxy_d1", [p], [d1], "--probe-timeout", "10")
    to_d2 = _proxy(logs, "proxy_d2", [p], [d2], "--probe-timeout", "10")
    procs = [p, d1, d2, to_d1, to_d2]
    try:
        _wait_healthy(procs)
        yield p, d1, d2, to_d1, to_d2
    finally:
        for s in procs:
            if s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGTERM)
        for s in procs:
            s.stop()


def test_tp2_prefill_through_the_proxy_equals_colocated(cluster):
    p, d1, d2, to_d1, to_d2 = cluster
    prompts = [" ".join(WORDS[:n]) for n in (1, 11)] + [" ".join(WORDS * 3)]
    wants = [complete(client(d1), prompt) for prompt in prompts]     # d1 serving them whole
    sent_before = metrics(p.url)["kdaserve:kv_transfer_sent_total"]
    for front, dec in ((to_d1, d1), (to_d2, d2)):
        proxied = client(front)
        for prompt, want in zip(prompts, wants):
            assert complete(proxied, prompt) == want, (front.log_path.name, prompt)
        assert complete(proxied, prompts[-1], stream=True)[0] == wants[-1][0]
        m = metrics(dec.url)
        assert m["kdaserve:kv_transfer_taken_total"] == len(prompts) + 1
        assert m["kdaserve:kv_transfer_refused_total"] == 0
    sent = metrics(p.url)
    assert sent["kdaserve:kv_transfer_sent_total"] - sent_before == 2 * (len(prompts) + 1)
    received = sum(metrics(d.url)["kdaserve:kv_transfer_received_bytes_total"] for d in (d1, d2))
    assert received == (sent["kdaserve:kv_transfer_sent_mla_bytes_total"]
                        + sent["kdaserve:kv_transfer_sent_kda_bytes_total"])
    deadline = time.monotonic() + 30
    for s in (p, d1, d2):
        m = wait_idle(s.url, timeout=30)
        while m["kdaserve:kv_transfer_pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
            m = metrics(s.url)
        assert m["kdaserve:kv_transfer_pending"] == m["kdaserve:kv_transfer_pending_bytes"] == 0
