"""A tensor-parallel prefill instance behind the real proxy, as processes on loopback, driven
with the official `openai` client: a TP=2 prefill instance (two gloo workers, one KDA head
each) feeds a TP=1 decode instance. Greedy output, streamed or not, equals colocated output
(the decode instance serving the request whole) token for token; the prefill ranks' bytes all
arrive and are taken; no instance keeps a page, a slot or an arrived cache (/metrics).
A TP=2 decode instance is tested in-process (test_tp_transfer.py: the same worker ranks and
receiving path as under `serve`), which spares this module three more processes.
"""

from __future__ import annotations

import time

import pytest
from server_harness import build_tiny_model, free_port, metrics, wait_idle
from test_proxy_server import KV, WORDS, _proxy, _serve, client, complete, healthy

# two servers (one with two worker ranks) and the proxy: ~40 s on a loaded 2-core machine
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # two MLA heads and two KDA heads: each rank gets one of each
    model = build_tiny_model(tmp_path_factory.mktemp("tp_model"), num_attention_heads=2)
    logs = tmp_path_factory.mktemp("disagg_tp_logs")
    p = _serve(model, logs, "prefill_tp2", "--block-size", "4", "--role", "prefill",
               "--tensor-parallel-size", "2", *KV)
    d = _serve(model, logs, "decode", "--block-size", "8", "--role", "decode",
               "--kv-transfer-port", str(free_port()), *KV)
    front = _proxy(logs, "proxy", [p], [d], "--probe-timeout", "10")
    with healthy([p, d, front]):
        yield p, d, front


def test_tp2_prefill_through_the_proxy_equals_colocated(cluster):
    p, d, front = cluster
    colocated, proxied = client(d), client(front)
    prompts = [" ".join(WORDS[:n]) for n in (1, 4, 11)] + [" ".join(WORDS * 3)]
    for i, prompt in enumerate(prompts):
        want = complete(colocated, prompt)
        assert complete(proxied, prompt) == want, prompt
        if i % 2:
            assert complete(proxied, prompt, stream=True)[0] == want[0]
    sent, got = metrics(p.url), metrics(d.url)
    moved = len(prompts) + len(prompts) // 2
    assert sent["kdaserve:kv_transfer_sent_total"] == moved
    assert got["kdaserve:kv_transfer_taken_total"] == moved
    assert got["kdaserve:kv_transfer_refused_total"] == 0
    assert got["kdaserve:kv_transfer_received_bytes_total"] == (
        sent["kdaserve:kv_transfer_sent_mla_bytes_total"]
        + sent["kdaserve:kv_transfer_sent_kda_bytes_total"])
    deadline = time.monotonic() + 30
    for s in (p, d):
        m = wait_idle(s.url, timeout=30)
        while m["kdaserve:kv_transfer_pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
            m = metrics(s.url)
        assert m["kdaserve:kv_transfer_pending"] == m["kdaserve:kv_transfer_pending_bytes"] == 0
