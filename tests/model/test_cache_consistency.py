"""Internal consistency: cached chunked prefill + decode == one full-sequence forward."""

from __future__ import annotations

import pytest
import torch

from kdaserve.model.batch import build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.kimi_linear import KimiLinearForCausalLM
from kdaserve.ops.mla import mla_decode_absorbed, mla_prefill_attention
from tiny_models import random_model, tiny_config


class CachedRunner:
    """Drives the model through the paged cache the way the engine does (fixed block lists)."""

    def __init__(self, model: KimiLinearForCausalLM, num_seqs: int, block_size: int = 4,
                 max_len: int = 96):
        cfg = model.config
        self.model, self.bs = model, block_size
        per = (max_len + block_size - 1) // block_size
        self.cache = HybridCache.allocate(cfg, num_seqs * per + 1, block_size, num_seqs + 1)
        # block 0 stays unused so a wrong index shows; sequence i owns blocks 1+i*per ..
        self.tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(num_seqs)]

    def step(self, seqs: list[int], chunks: list[list[int]], ctx: list[int]) -> torch.Tensor:
        """Run one forward over the given chunks; returns logits of each chunk's last token."""
        lens = [len(c) for c in chunks]
        order = sorted(range(len(seqs)), key=lambda i: (lens[i] != 1 or ctx[i] == 0))
        num_decode = sum(1 for i in order if lens[i] == 1 and ctx[i] > 0)
        seqs = [seqs[i] for i in order]
        chunks = [chunks[i] for i in order]
        ctx = [ctx[i] for i in order]
        lens = [len(c) for c in chunks]
        last = torch.tensor(lens).cumsum(0) - 1
        fb = build_forward_batch(
            lens, ctx, num_decode=num_decode, conv_kernel=self.model.config.conv_kernel_size,
            chunk_size=self.model.chunk_size, cache=self.cache,
            block_tables=[self.tables[s] for s in seqs], state_slots=[s + 1 for s in seqs],
            logits_indices=last,
        )
        ids = torch.tensor([t for c in chunks for t in c])
        with torch.no_grad():
            logits, _ = self.model(ids, fb)
        inv = torch.empty(len(order), dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(len(order))
        return logits[inv]


@pytest.mark.parametrize("chunk", [1, 3, 8, 100])
def test_chunked_prefill_then_decode_equals_full_forward(chunk):
    cfg = tiny_config()
    model = random_model(cfg)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (23, 9, 40)]
    runner = CachedRunner(model, 3)
    ctx = [0, 0, 0]
    prompt_len = [len(s) - 5 for s in seqs]
    got = {i: [] for i in range(3)}
    # prefill in chunks, all sequences in the same batch (different progress per sequence)
    while any(ctx[i] < prompt_len[i] for i in range(3)):
        live = [i for i in range(3) if ctx[i] < prompt_len[i]]
        pieces = [seqs[i][ctx[i]: min(prompt_len[i], ctx[i] + chunk)] for i in live]
        runner.step(live, pieces, [ctx[i] for i in live])
        for i, p in zip(live, pieces):
            ctx[i] += len(p)
    for _ in range(5):  # decode the remaining tokens teacher-forced, batched
        logits = runner.step([0, 1, 2], [[seqs[i][ctx[i]]] for i in range(3)], ctx)
        for i in range(3):
            got[i].append(logits[i])
            ctx[i] += 1
    with torch.no_grad():
        for i in range(3):
            full = model.forward_dense(torch.tensor([seqs[i]]))[0]
            want = full[prompt_len[i]: prompt_len[i] + 5]
            assert (torch.stack(got[i]) - want).abs().max() < 1e-4


def test_fresh_prompts_attend_causally_without_a_mask():
    """Fresh prompts of one length: the layout builds no mask (plain causal over their own
    rows, the attention skipping the future) and the logits are those of the masked layout
    (the same keys, the future masked instead)."""
    cfg = tiny_config()
    model = random_model(cfg, seed=4)
    g = torch.Generator().manual_seed(4)
    chunks = [torch.randint(0, 64, (13,), generator=g).tolist() for _ in range(2)]
    causal, masked = CachedRunner(model, 2), CachedRunner(model, 2)
    fb = build_forward_batch([13, 13], [0, 0], conv_kernel=4, chunk_size=8,
                             cache=causal.cache, block_tables=causal.tables,
                             state_slots=[1, 2])
    assert fb.mla.prefill_causal and fb.mla.prefill_mask is None
    got = causal.step([0, 1], chunks, [0, 0])

    real = build_forward_batch

    def with_mask(*args, **kw):        # the same step, its causal mask built explicitly
        fb = real(*args, **kw)
        lay = fb.mla
        if lay.prefill_causal:
            keys = lay.prefill_ctx_blocks.shape[1] * masked.bs
            qi = torch.arange(lay.prefill_q_idx.shape[1])
            lay.prefill_mask = (torch.arange(keys)[None, None, :] <= qi[None, :, None]
                                )[:, None].expand(len(chunks), 1, -1, -1)
            lay.prefill_causal = False
        return fb

    globals()["build_forward_batch"] = with_mask
    try:
        want = masked.step([0, 1], chunks, [0, 0])
    finally:
        globals()["build_forward_batch"] = real
    assert (got - want).abs().max() < 1e-5
    unequal = build_forward_batch([13, 12], [0, 0], conv_kernel=4, chunk_size=8,
                                  cache=causal.cache, block_tables=causal.tables,
                                  state_slots=[1, 2])
    assert not unequal.mla.prefill_causal and unequal.mla.prefill_mask is not None


def test_packed_varlen_batch_equals_per_sequence_runs():
    cfg = tiny_config()
    model = random_model(cfg, seed=1)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in (1, 7, 16, 29)]
    fb = build_forward_batch([len(s) for s in seqs], conv_kernel=4, chunk_size=8)
    with torch.no_grad():
        packed, _ = model(torch.cat(seqs), fb)
        start = 0
        for s in seqs:
            alone = model.forward_dense(s[None])[0]
            assert (packed[start:start + len(s)] - alone).abs().max() < 1e-4
            start += len(s)


def test_paged_absorbed_mla_decode_equals_naive_attention():
    g = torch.Generator().manual_seed(3)
    B, H, N, R, Dc, Vd, L = 3, 4, 8, 4, 12, 6, 11
    w = torch.randn(H, N + Vd, Dc, generator=g)
    lat = torch.randn(B, L, Dc + R, generator=g)
    lens = torch.tensor([11, 4, 7])
    mask = torch.arange(L)[None] < lens[:, None]
    q = torch.randn(B, H, N + R, generator=g)
    out = mla_decode_absorbed(q[..., :N], q[..., N:], lat, mask, w[:, :N], w[:, N:], 0.3)
    kv = torch.einsum("blc,hdc->blhd", lat[..., :Dc], w)
    k = torch.cat([kv[..., :N], lat[..., Dc:, ].unsqueeze(2).expand(B, L, H, R)], -1)
    for b in range(B):
        n = int(lens[b])
        ref = mla_prefill_attention(q[b:b + 1, None], k[b:b + 1, :n], kv[b:b + 1, :n, :, N:],
                                    torch.ones(1, 1, 1, n, dtype=torch.bool), 0.3)
        assert (out[b] - ref[0, 0]).abs().max() < 1e-5


def test_rope_variant_cached_equals_full():
    cfg = tiny_config(mla_use_nope=False, q_lora_rank=10)
    model = random_model(cfg, seed=2)
    seq = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = CachedRunner(model, 1)
    runner.step([0], [seq[:13]], [0])
    outs = [runner.step([0], [[seq[i]]], [i])[0] for i in range(13, 20)]
    with torch.no_grad():
        full = model.forward_dense(torch.tensor([seq]))[0, 13:20]
    assert (torch.stack(outs) - full).abs().max() < 1e-4
