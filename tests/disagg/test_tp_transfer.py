"""Tensor-parallel instances on either side of a transfer (gloo worker processes, two ranks,
one KDA head each), over real sockets; greedy output equals the colocated one-process
engine's, token for token, one request at a time and all at once, and no side leaks:

- TP=2 prefill -> TP=1 decode: each prefill rank sends its heads' KDA states and conv
  windows (rank 0 the latents too, pushed while a long prompt computes in chunks); the
  decode side joins them.
- TP=1 prefill -> TP=2 decode: the decode instance's rank 0 receives the whole transfer and
  hands each rank its heads' share and the latents (kdaserve/disagg/rank_receive.py).
- TP=2 -> TP=2: joined on the decode instance's rank 0, then split again.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.config import ConfigError
from kdaserve.disagg.local import run_colocated, run_disaggregated
from kdaserve.disagg.params import KVTransferParams
from kdaserve.model.loader import save_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(traces) -> list[list[int]]:
    assert all(t.error is None for t in traces), [t.error for t in traces]
    return [t.tokens for t in traces]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_transfer")
    save_model(random_model(tiny_config(num_attention_heads=2)), out)
    model = str(out)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (1, 6, 13, 37)]
    ref = LLM(model, block_size=4, num_threads=1, enable_prefix_caching=False)
    expected = tokens(run_colocated(ref.engine, ps, GREEDY))
    # chunks of 8 tokens: (rank 0) pushes the latents while the next chunk computes
    pre1 = LLM(model, role="prefill", block_size=4, num_threads=1, max_num_batched_tokens=8)
    pre2 = LLM(model, tensor_parallel_size=2, role="prefill", block_size=4, num_threads=1,
               max_num_batched_tokens=8, cache_memory=8 << 20)
    dec1 = LLM(model, block_size=8, role="decode", kv_transfer_port=0, num_threads=1,
               enable_prefix_caching=False)
    # a short receive timeout: the test of a transfer that never comes waits for it
    dec2 = LLM(model, tensor_parallel_size=2, block_size=8, role="decode", kv_transfer_port=0,
               num_threads=1, cache_memory=8 << 20, kv_transfer_timeout=1.0)
    yield {"pre1": pre1, "pre2": pre2, "dec1": dec1, "dec2": dec2, "ref": ref}, ps, expected
    for e in (pre2, dec2):
        e.shutdown()
    dec1.engine.transfer.connector.close()


@pytest.mark.parametrize("pre,dec", [("pre2", "dec1"), ("pre1", "dec2"), ("pre2", "dec2")])
def test_tensor_parallel_transfer_equals_colocated(engines, pre, dec):
    e, ps, expected = engines
    pre, dec = e[pre].engine, e[dec].engine
    before = dec.transfer.metrics()
    for p, want in zip(ps, expected):
        assert tokens(run_disaggregated(pre, dec, [p], GREEDY)) == [want]
    assert tokens(run_disaggregated(pre, dec, ps, GREEDY)) == expected
    recv = dec.transfer.metrics()
    assert recv["taken"] - before["taken"] == 2 * len(ps)
    assert recv["pending"] == 0 and recv["refused"] == 0
    assert pre.transfer.metrics()["parts_pushed"] > 0
    for eng in (pre, dec):
        assert eng.cache.all_free()


@pytest.mark.parametrize("pre", ["pre1", "pre2"])
def test_tp2_decode_second_turn_hit(engines, pre):
    """A chat's second turn that hits the TP=2 decode instance's prefix cache: the hold is its
    scheduler's, the transfer leaves out the held tokens (from each prefill rank alike), rank
    0 splits what came and every rank installs its share after the shared blocks."""
    e, ps, _ = engines
    pre, dec = e[pre].engine, e["dec2"].engine
    first = ps[-1]                               # 37 tokens: the answer crosses 40
    [answer] = tokens(run_disaggregated(pre, dec, [first], GREEDY))
    second = first + answer + [5, 6, 7, 8, 9, 10, 11]
    [want] = tokens(run_colocated(e["ref"].engine, [second], GREEDY))
    moved = {}
    for hit_query in (True, False):
        hits, sent = dec.cache.stats.hit_tokens, pre.transfer.metrics()["sent_mla_bytes"]
        assert tokens(run_disaggregated(pre, dec, [second], GREEDY,
                                        hit_query=hit_query)) == [want]
        moved[hit_query] = (dec.cache.stats.hit_tokens - hits,
                            pre.transfer.metrics()["sent_mla_bytes"] - sent)
    (held, with_hits), (_, whole) = moved[True], moved[False]
    n = len(second)
    assert held == 40 and with_hits * n == whole * (n - held)
    for eng in (pre, dec):
        assert eng.cache.all_free()


def test_tp2_prefill_counts_both_ranks_bytes(engines):
    e, ps, _ = engines
    pre, dec = e["pre2"].engine, e["dec1"].engine
    before, got = pre.transfer.metrics(), dec.transfer.connector.stats.received_bytes
    run_disaggregated(pre, dec, ps[-1:], GREEDY)
    sent = pre.transfer.metrics()                # both ranks' counters, through the executor
    assert sent["sent"] - before["sent"] == 1
    moved = sum(sent[k] - before[k] for k in ("sent_mla_bytes", "sent_kda_bytes"))
    assert moved == dec.transfer.connector.stats.received_bytes - got


def test_tp2_decode_transfer_that_never_comes(engines):
    """Rank 0 finds nothing within the timeout: every rank fails the receive alike (no rank
    waits for bytes), the request ends with the error, its blocks and slot are freed."""
    e, ps, _ = engines
    dec = e["dec2"].engine
    params = replace(GREEDY, kv_transfer=KVTransferParams("never-sent", first_token_id=5))
    (trace,) = run_colocated(dec, [ps[2]], params)
    assert trace.error is not None and "did not arrive within 1 s" in trace.error
    assert dec.transfer.metrics()["missing"] == 1
    assert dec.cache.all_free()


def test_data_parallel_instances_are_refused(engines):
    e, *_ = engines
    with pytest.raises(ConfigError, match="--role decode runs tensor parallel only"):
        LLM(e["pre1"].engine.config.model, tensor_parallel_size=1, expert_parallel_size=2,
            data_parallel_size=2, role="decode", kv_transfer_port=0, num_threads=1)
