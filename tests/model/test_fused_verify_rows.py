"""Verify rows (a token and its drafts: consecutive positions of one sequence) at contexts
long enough that csrc/mla_attend.h splits each row's MLA attention into several ranges: each
row's logits must be the same bits as decoding its token alone, one step after another, or
greedy speculation would drift from plain decoding at long context."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import needs_kernels, require
from fused_cases import clone_cache, prefill
from tiny_models import random_model, tiny_config

from kdaserve.model.fused_decode import Kept, fused_decoder
from kdaserve.model.hybrid_cache import HybridCache

pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _built():
    from kdaserve.ops.cpu_kernels import decode_block_kernels

    require(decode_block_kernels(), "csrc/decode_cpu.c")


# (heads, latent rank): each head's dots, and the heads as lanes; (context, rows): 382 + 5
# rows cross from three ranges of 128 positions to four (the last rows read one range more);
# 2,044 + 8 rows cross from ranges of 128 positions to 129
@pytest.mark.parametrize("heads,rank", [(3, 12), (16, 80)])
@pytest.mark.parametrize("n,k", [(382, 5), (2044, 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_verify_rows_read_together_equal_each_row_alone(threads, heads, rank, n, k):
    cfg = tiny_config(num_attention_heads=heads, kv_lora_rank=rank)
    model = random_model(cfg, seed=7).fuse_for_inference()
    bs = 16
    blocks = (n + k) // bs + 1
    cache = HybridCache.allocate(cfg, blocks + 2, bs, 4)
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    table = list(range(1, blocks + 1))
    prefill(model, cache, [table], [2], [prompt])
    alone_cache = clone_cache(cache)
    ids = torch.randint(0, cfg.vocab_size, (k,), generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = fused_decoder(model, cache)(
            ids, torch.arange(n, n + k), torch.full((k,), 2), torch.tensor([table] * k), cache,
            kept=Kept.allocate(cache, k))
        step = fused_decoder(model, alone_cache)
        alone = torch.cat([step(ids[j:j + 1], torch.tensor([n + j]), torch.tensor([2]),
                                torch.tensor([table]), alone_cache) for j in range(k)])
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(together, alone)
    for a, b in zip(cache.mla_pages, alone_cache.mla_pages):
        assert torch.equal(a, b)
