"""The benchmark's deployment-like mode (kdaserve/disagg/split_run.py): a prefill engine in a
process of its own (pinned to CPU 0) runs at the same time as the decode engine in this one;
greedy output equals the colocated engine's, token for token, all prompts at once (a 37-token
prompt prefilled in chunks of 8, so parts are pushed), and the prefill side's counters over
the batch come back."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.disagg.local import run_colocated
from kdaserve.disagg.split_run import PrefillProcess
from kdaserve.model.loader import save_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

# a spawned process that imports torch and kdaserve: ~30 s on a loaded 2-core machine
pytestmark = pytest.mark.slow


def test_prefill_in_its_own_process_equals_colocated(tmp_path):
    save_model(random_model(tiny_config()), tmp_path)
    model = str(tmp_path)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (1, 13, 37)]
    ref = LLM(model, block_size=4, num_threads=1, enable_prefix_caching=False)
    expected = [t.tokens for t in run_colocated(ref.engine, ps, GREEDY)]
    dec = LLM(model, block_size=8, role="decode", kv_transfer_port=0, num_threads=1,
              enable_prefix_caching=False).engine
    proc = PrefillProcess(model, {"block_size": 4, "num_threads": 1,
                                  "max_num_batched_tokens": 8}, dec.transfer.address, {0})
    try:
        traces, moved = proc.run(dec, ps, GREEDY)
    finally:
        proc.close()
        dec.transfer.connector.close()
    assert [t.error for t in traces] == [None] * len(ps)
    assert [t.tokens for t in traces] == expected
    assert moved["sent"] == len(ps) and moved["parts_pushed"] > 0
    assert moved["send_seconds"] > 0 and moved["steps"] >= 5     # 37 tokens in chunks of 8
    assert dec.cache.all_free() and dec.transfer.metrics()["pending"] == 0
