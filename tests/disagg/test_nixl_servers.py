"""The NIXL connector between real processes on loopback: a prefill instance (`--kv-connector
nixl`), a decode instance (vLLM's `--kv-transfer-config` JSON) and `kdaserve proxy`, driven
with the official `openai` client. Greedy output through the proxy equals the decode
instance's colocated output, token for token, streaming too; every cache was READ over NIXL
by the decode process; afterwards neither instance holds a page or an arrived cache."""

from __future__ import annotations

import json

import pytest
from server_harness import free_port, metrics, wait_idle
from test_proxy_server import KV, WORDS, _proxy, _serve, client, complete, healthy

pytest.importorskip("nixl", reason="nixl is not installed (pip install 'kdaserve[disagg]')")


@pytest.fixture(scope="module")
def nixl_cluster(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("nixl_logs")
    p = _serve(tiny_model_dir, logs, "prefill", "--block-size", "4", "--role", "prefill",
               "--kv-connector", "nixl", *KV)
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
              "kv_ip": "127.0.0.1", "kv_port": free_port()}
    d = _serve(tiny_model_dir, logs, "decode", "--block-size", "8", "--kv-transfer-config",
               json.dumps(config), *KV)
    front = _proxy(logs, "proxy", [p], [d], "--probe-timeout", "10")
    with healthy([p, d, front]):
        yield p, d, front


def test_greedy_output_equals_colocated_over_nixl(nixl_cluster):
    p, d, front = nixl_cluster
    colocated, proxied = client(d), client(front)
    prompts = [" ".join(WORDS[:n]) for n in (1, 6, 15)] + [" ".join(WORDS * 3)]
    for prompt in prompts:
        want = complete(colocated, prompt)
        assert complete(proxied, prompt) == want, prompt
    assert complete(proxied, prompts[-1], stream=True)[0] == want[0]
    sent = metrics(p.url)["kdaserve:kv_transfer_sent_total"]
    assert sent == len(prompts) + 1
    m = wait_idle(d.url)
    assert m["kdaserve:kv_transfer_taken_total"] == sent
    assert m["kdaserve:kv_transfer_refused_total"] == 0    # a zmq sender would be refused
    for s in (p, d):
        m = wait_idle(s.url)
        assert m["kdaserve:kv_transfer_pending"] == m["kdaserve:kv_transfer_pending_bytes"] == 0
