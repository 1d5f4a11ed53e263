"""A tensor-parallel prefill instance (TP=2: two gloo worker processes, one KDA head each)
feeds a one-rank decode instance over a real socket: each rank sends its heads' KDA states
and conv windows (rank 0 the latents too, pushed while a long prompt computes in chunks), the
decode side joins them, and greedy output equals the colocated one-process engine's, token
for token, one request at a time and all at once. Both sides leak nothing."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.config import ConfigError
from kdaserve.disagg.local import run_colocated, run_disaggregated
from kdaserve.model.loader import save_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(traces) -> list[list[int]]:
    assert all(t.error is None for t in traces), [t.error for t in traces]
    return [t.tokens for t in traces]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_prefill")
    save_model(random_model(tiny_config(num_attention_heads=2)), out)
    model = str(out)
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (1, 6, 13, 37)]
    ref = LLM(model, block_size=4, num_threads=1, enable_prefix_caching=False)
    expected = tokens(run_colocated(ref.engine, ps, GREEDY))
    # chunks of 8 tokens: rank 0 pushes the latents while the next chunk computes
    pre = LLM(model, tensor_parallel_size=2, role="prefill", block_size=4, num_threads=1,
              max_num_batched_tokens=8, cache_memory=8 << 20)
    dec = LLM(model, block_size=8, role="decode", kv_transfer_port=0, num_threads=1,
              enable_prefix_caching=False)
    yield pre, dec, ps, expected
    pre.shutdown()
    dec.engine.transfer.connector.close()


def test_tp2_prefill_to_tp1_decode_equals_colocated(engines):
    pre, dec, ps, expected = engines
    for p, want in zip(ps, expected):
        assert tokens(run_disaggregated(pre.engine, dec.engine, [p], GREEDY)) == [want]
    assert tokens(run_disaggregated(pre.engine, dec.engine, ps, GREEDY)) == expected
    recv = dec.engine.transfer.connector.stats
    assert recv.taken == 2 * len(ps) and recv.pending == 0 and recv.refused == 0
    sent = pre.engine.transfer.metrics()         # both ranks' counters, through the executor
    assert sent["sent"] == 2 * len(ps) and sent["parts_pushed"] > 0
    assert sent["sent_kda_bytes"] == recv.received_bytes - sent["sent_mla_bytes"]
    for e in (pre, dec):
        assert e.engine.cache.all_free()


def test_a_tensor_parallel_decode_instance_is_refused(engines):
    pre, *_ = engines
    with pytest.raises(ConfigError, match="--role decode runs one rank"):
        LLM(pre.engine.config.model, tensor_parallel_size=2, role="decode",
            kv_transfer_port=0, num_threads=1)
