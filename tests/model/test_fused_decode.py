"""The fused CPU decode path (kdaserve.model.fused_decode) against the model's torch forward,
its reference: same logits to rounding, same cache contents, same greedy tokens. The bf16 path
against the fp32 forward: of the same bf16-rounded weights (to rounding), and of the bundled
model's fp32 weights through the engine (same greedy tokens, logprobs within 0.15)."""

from __future__ import annotations

import copy

import pytest
import torch
from compiled_kernels import needs_kernels, require
from fused_cases import clone_cache as _clone
from fused_cases import prefill as _prefill
from fused_cases import round_to_bf16 as _round_to_bf16
from fused_cases import step_against_forward as _step
from tiny_models import random_model, tiny_config
from torch import nn

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.llm import LLM
from kdaserve.model.batch import build_forward_batch
from kdaserve.model.kept_states import ForwardKept
from kdaserve.model.layout.snapshots import SnapshotAt
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.fused_decode import FusedDecoder, fused_decoder, supports
from kdaserve.model.moe import SparseMoE
from kdaserve.request import SamplingParams

pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _built():
    from kdaserve.ops.cpu_kernels import decode_block_kernels

    require(decode_block_kernels(), "csrc/decode_cpu.c")


def _full_rank_config():
    return tiny_config(linear_attn_config={
        "kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 8,
        "short_conv_kernel_size": 4, "use_full_rank_gate": True})


@pytest.mark.parametrize("gate", ["low_rank", "full_rank", "no_shared"])
@pytest.mark.parametrize("rows", [1, 3])
def test_step_matches_torch_forward(gate, rows):
    cfg = (_full_rank_config() if gate == "full_rank"
           else tiny_config(num_shared_experts=0) if gate == "no_shared" else tiny_config())
    assert cfg.kda_full_rank_gate == (gate == "full_rank")
    model = random_model(cfg, seed=rows).fuse_for_inference()
    bs = 4
    cache = HybridCache.allocate(cfg, 64, bs, 8, num_snapshots=4)
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
               for n in (9, 5, 14)[:rows]]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(rows)]
    slots = [2 + i for i in range(rows)]
    _prefill(model, cache, tables, slots, prompts)
    ref_cache = _clone(cache)
    fused = fused_decoder(model, cache)
    assert isinstance(fused, FusedDecoder) and fused.wdtype == torch.float32
    for step in range(4):
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * rows, ctx, num_decode=rows,
                                 conv_kernel=cfg.conv_kernel_size, chunk_size=model.chunk_size,
                                 cache=ref_cache, block_tables=tables, state_slots=slots,
                                 snapshots=[SnapshotAt(0, ctx[0] + 1, step)])
        with torch.inference_mode():
            want, want_hidden = model(ids, fb, capture_layers=(0, 2))
        hidden: list[torch.Tensor] = []
        got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache,
                    snapshots=[(0, step)], capture=(0, 2), captured=hidden)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert len(hidden) == 2           # a draft's context: the stream after those layers
        for h, w in zip(hidden, want_hidden):
            torch.testing.assert_close(h, w, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for name in ("kda_states", "kda_conv", "mla_pages", "snap_states", "snap_conv"):
        for a, b in zip(getattr(cache, name), getattr(ref_cache, name)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# MLA heads and latent ranks: 3 heads take each head's own dots (csrc/mla_attend.h
# mla_dots), 9 and 16 the heads as lanes (mla_scores16; 9 padded to 16); the ranks take the
# context's scalar tail (12), its 64 and 16 wide sums (80)
MLA_SHAPES = [(3, 12), (9, 12), (16, 80)]


@pytest.mark.parametrize("heads,rank", MLA_SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_row_matches_torch_forward(threads, heads, rank):
    """A lone row of 300 positions: its MLA attention runs as three ranges of 128 positions
    and less, merged (csrc/mla_attend.h), on one thread or over two."""
    cfg = tiny_config(num_attention_heads=heads, kv_lora_rank=rank)
    model = random_model(cfg, seed=12).fuse_for_inference()
    bs, n = 16, 300
    cache = HybridCache.allocate(cfg, 24, bs, 4)
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    tables, slots = [list(range(1, 21))], [1]
    _prefill(model, cache, tables, slots, [prompt])
    ref_cache = _clone(cache)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = fused_decoder(model, cache)
        for step in range(2):
            ids = torch.randint(0, cfg.vocab_size, (1,), generator=g)
            _step(model, fused, ids, [n + step], tables, slots, cache, ref_cache)
    finally:
        torch.set_num_threads(saved)


def test_verify_rows_match_the_torch_verify_forward():
    """A token and its 3 drafts as 4 rows sharing a slot (consecutive positions), beside a
    plain decode row: the logits of every position, the states kept after each position (a
    rejected draft's rollback) and the final cache match the torch forward's verify step."""
    from kdaserve.model.fused_decode import Kept

    cfg = tiny_config()
    model = random_model(cfg, seed=11).fuse_for_inference()
    bs = 4
    cache = HybridCache.allocate(cfg, 32, bs, 4, num_snapshots=2)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 10)]
    tables, slots = [list(range(1, 9)), list(range(9, 17))], [1, 3]
    _prefill(model, cache, tables, slots, prompts)
    ref_cache = _clone(cache)
    lens, ctx = [4, 1], [len(p) for p in prompts]
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
    fb = build_forward_batch(lens, ctx, num_decode=2, conv_kernel=cfg.conv_kernel_size,
                             chunk_size=model.chunk_size, cache=ref_cache, block_tables=tables,
                             state_slots=slots, logits_indices=list(range(sum(lens))))
    with torch.inference_mode():
        want, _ = model(ids, fb)
    fused = fused_decoder(model, cache)
    kept = Kept.allocate(cache, sum(lens))
    positions = torch.tensor([ctx[0] + j for j in range(4)] + [ctx[1]])
    row_slots = torch.tensor([1, 1, 1, 1, 3])
    table = torch.tensor([tables[0]] * 4 + [tables[1]])
    got = fused(ids, positions, row_slots, table, cache, kept=kept)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i in range(len(cache.kda_states)):
        for j in range(4):                 # the states after each position of the verify row
            torch.testing.assert_close(kept.states[i][j], fb.out.decode_states[i][0, j],
                                       rtol=1e-4, atol=1e-5)
    for name in ("kda_states", "kda_conv", "mla_pages"):
        for a, b in zip(getattr(cache, name), getattr(ref_cache, name)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # rolling the verify row back to its second position: the slot holds what kept says
    kept.copy_to(torch.tensor([1]), cache.kda_states, cache.kda_conv, torch.tensor([1]))
    ForwardKept(fb).copy_to(torch.tensor([0]), torch.tensor([1]), ref_cache.kda_states,
                           ref_cache.kda_conv, torch.tensor([1]))
    for name in ("kda_states", "kda_conv"):
        for a, b in zip(getattr(cache, name), getattr(ref_cache, name)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# matrices of 2 MiB and more (the MLP, the experts, the LM head in fp32) sum in two halves of
# K (csrc/ksplit.h): one row takes the split-by-K path, many rows the tiles
WIDE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
            vocab_size=1024)
# the same in bf16 (2 MiB from 1M weights): a lone row's products, dense and experts, split
# over the threads by K halves (csrc/rows_split.h), many rows' take the tiles
WIDE_BF16 = dict(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=1024,
                 vocab_size=1024, num_experts=3)


# 16 MLA heads: their scores with the heads as lanes (csrc/mla_attend.h mla_scores16)
HEADS = dict(num_attention_heads=16, kv_lora_rank=80)


@pytest.mark.parametrize("dtype,shape", [(torch.float32, "tiny"), (torch.bfloat16, "tiny"),
                                         (torch.float32, "wide"), (torch.bfloat16, "wide"),
                                         (torch.float32, "heads"), (torch.bfloat16, "heads")])
def test_many_rows_split_over_threads_equal_one_row_at_a_time(dtype, shape):
    """15 rows (the kernels' 4-row tiles leave 3: a 2-row tile and one) in one step, split
    over 2 threads,
    give each row exactly what it gets alone (logits and cache): the dot products sum in the
    same order whatever the batch; in fp32 the logits match the torch forward of the rows."""
    wide = WIDE_BF16 if dtype == torch.bfloat16 else WIDE
    cfg = tiny_config(**{"wide": wide, "heads": HEADS}.get(shape, {}))
    model = random_model(cfg, seed=5).to(dtype).fuse_for_inference()
    if shape == "wide":      # a 4 KiB row of fp32 vocabulary: the head's store is padded
        assert model.lm_head.weight.stride(1) == cfg.vocab_size + (
            16 if dtype == torch.float32 else 0)
    rows, bs = 15, 4
    cache = HybridCache.allocate(cfg, 4 * rows + 1, bs, rows + 1, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (3 + i % 11,), generator=g).tolist()
               for i in range(rows)]
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(rows)]
    slots = list(range(1, rows + 1))
    _prefill(model, cache, tables, slots, prompts)
    alone_cache, ref_cache = _clone(cache), _clone(cache)
    fused = fused_decoder(model, cache)
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
    ctx = torch.tensor([len(p) for p in prompts])
    table, slot_t = torch.tensor(tables), torch.tensor(slots)
    together = fused(ids, ctx, slot_t, table, cache, parts=2)
    alone = torch.cat([fused(ids[i:i + 1], ctx[i:i + 1], slot_t[i:i + 1], table[i:i + 1],
                             alone_cache) for i in range(rows)])
    assert torch.equal(together, alone)
    for name in ("kda_states", "kda_conv", "mla_pages"):
        for a, b in zip(getattr(cache, name), getattr(alone_cache, name)):
            assert torch.equal(a, b), name
    if dtype != torch.float32:     # bf16 against fp32: test_bf16_step_matches_fp32_...
        return
    fb = build_forward_batch([1] * rows, ctx.tolist(), num_decode=rows,
                             conv_kernel=cfg.conv_kernel_size, chunk_size=model.chunk_size,
                             cache=ref_cache, block_tables=tables, state_slots=slots)
    with torch.inference_mode():
        want, _ = model(ids, fb)
    torch.testing.assert_close(together, want, rtol=1e-4, atol=1e-4)


def test_bf16_lone_row_is_the_same_on_any_thread_count():
    """A lone bf16 row's products split over the threads (csrc/rows_split.h): two threads
    take a K half each, four split each half's outputs in two ranges (whose streams prefetch
    their own rows' runs), one runs them whole; every product sums the same halves in the same
    order, so the logits and the cache are the same bits."""
    cfg = tiny_config(**WIDE_BF16)
    model = random_model(cfg, seed=11).to(torch.bfloat16).fuse_for_inference()
    rows, bs = 2, 4
    cache = HybridCache.allocate(cfg, 4 * rows + 1, bs, rows + 1, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (5 + 4 * i,), generator=g).tolist()
               for i in range(rows)]
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(rows)]
    slots = list(range(1, rows + 1))
    _prefill(model, cache, tables, slots, prompts)
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            mine = _clone(cache)
            fused = fused_decoder(model, mine)
            ids = torch.tensor([7, 11])
            ctx = torch.tensor([len(p) for p in prompts])
            logits = torch.cat([fused(ids[i:i + 1], ctx[i:i + 1], torch.tensor(slots[i:i + 1]),
                                      torch.tensor(tables[i:i + 1]), mine)
                                for i in range(rows)])
            outs[threads] = (logits, mine)
    finally:
        torch.set_num_threads(before)
    for threads in (2, 4):
        assert torch.equal(outs[threads][0], outs[1][0]), threads
        for name in ("kda_states", "kda_conv", "mla_pages"):
            for a, b in zip(getattr(outs[threads][1], name), getattr(outs[1][1], name)):
                assert torch.equal(a, b), (threads, name)


@pytest.mark.parametrize("gate", ["low_rank", "full_rank"])
@pytest.mark.parametrize("experts", ["transposed", "checkpoint"])
def test_bf16_step_matches_fp32_forward_of_the_rounded_weights(gate, experts):
    """bf16 weights and cache, fp32 sums: the torch fp32 forward of the same rounded weights,
    its cache rounded to bf16 after each step, is the oracle. They differ by summation order
    and by the step's own MLA latent, which the fused path attends to as stored (bf16) and
    torch before storing (fp32): logits within 2e-2 (measured under 6e-3 on 12 models, scale
    ~6), greedy identical, cache entries within a bf16 rounding step."""
    cfg = _full_rank_config() if gate == "full_rank" else tiny_config()
    model = random_model(cfg, seed=7).fuse_for_inference().to_dtype(torch.bfloat16)
    for layer in model.model.layers:
        if isinstance(layer.ffn, SparseMoE) and experts == "checkpoint":
            for name in ("experts_w13", "experts_w2"):   # the checkpoint layout, also read
                w = getattr(layer.ffn, name)
                setattr(layer.ffn, name, nn.Parameter(w.detach().contiguous(),
                                                      requires_grad=False))
        if isinstance(layer.ffn, SparseMoE):
            assert (layer.ffn.experts_w13.transpose(1, 2).is_contiguous()
                    == (experts == "transposed"))
    ref_model = copy.deepcopy(model).to_dtype(torch.float32)
    rows, g = 3, torch.Generator().manual_seed(7)
    ref_cache = HybridCache.allocate(cfg, 64, 4, 8)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 14)]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(rows)]
    slots = [2, 3, 4]
    _prefill(ref_model, ref_cache, tables, slots, prompts)
    _round_to_bf16(ref_cache)
    cache = _clone(ref_cache, torch.bfloat16)
    fused = fused_decoder(model, cache)
    assert isinstance(fused, FusedDecoder) and fused.wdtype == torch.bfloat16
    assert all(w.dtype == torch.bfloat16 for w in fused._keep if w.dim() == 3)   # experts
    for step in range(5):
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * rows, ctx, num_decode=rows,
                                 conv_kernel=cfg.conv_kernel_size, chunk_size=model.chunk_size,
                                 cache=ref_cache, block_tables=tables, state_slots=slots)
        with torch.inference_mode():
            want, _ = ref_model(ids, fb)
        _round_to_bf16(ref_cache)
        got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for a, b in zip(cache.kda_states, ref_cache.kda_states):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for name in ("kda_conv", "mla_pages"):
        for a, b in zip(getattr(cache, name), getattr(ref_cache, name)):
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b, rtol=2 ** -7, atol=2e-2)


def test_not_for_other_dtypes_or_rope():
    cfg = tiny_config()
    cache = HybridCache.allocate(cfg, 8, 4, 2)
    bf16_cache = HybridCache.allocate(cfg, 8, 4, 2, dtype=torch.bfloat16)
    assert supports(random_model(cfg), cache)
    assert supports(random_model(cfg).to_dtype(torch.bfloat16), bf16_cache)
    assert not supports(random_model(cfg).to_dtype(torch.bfloat16), cache)
    assert not supports(random_model(cfg), bf16_cache)
    assert not supports(random_model(cfg).to_dtype(torch.float16),
                        HybridCache.allocate(cfg, 8, 4, 2, dtype=torch.float16))
    assert not supports(random_model(tiny_config(mla_use_nope=False)), cache)


def test_engine_greedy_same_with_and_without(monkeypatch, hf_checkpoint):
    """Through the engine: one stream and a few at once, fused and torch decode agree."""
    path, _ = hf_checkpoint
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 3, 17], [8] * 11, [1, 2, 3, 4, 5, 6])]
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("KDASERVE_FUSED_DECODE", mode)
        llm = LLM(str(path), max_num_seqs=4, block_size=4)
        single = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                  for p in prompts]
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        used = isinstance(llm.engine.runner._fused, FusedDecoder)
        assert used == (mode == "1")
        outs[mode] = (single, batch)
        llm.close()
    assert outs["0"] == outs["1"]
    assert outs["1"][0] == outs["1"][1]


def test_engine_bf16_greedy_same_as_fp32(monkeypatch):
    """`dtype="bfloat16"` (the server's --dtype bfloat16) takes the fused bf16 path, and on the
    bundled model it decodes the same greedy tokens as the fp32 torch forward, each token's
    logprob within 0.15 (measured 0.07 over these prompts; prefill is the torch bf16 forward)."""
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):"]
    outs = {}
    for dtype, mode in (("float32", "0"), ("bfloat16", "1")):
        monkeypatch.setenv("KDASERVE_FUSED_DECODE", mode)
        llm = LLM(str(kimi_linear_demo_path()), dtype=dtype)
        outs[dtype] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        fused = llm.engine.runner._fused
        assert isinstance(fused, FusedDecoder) == (mode == "1")
        if mode == "1":
            assert fused.wdtype == torch.bfloat16
            moe = [layer.ffn for layer in llm.engine.runner.model.model.layers
                   if isinstance(layer.ffn, SparseMoE)]
            assert moe and all(m.experts_w13.transpose(1, 2).is_contiguous() for m in moe)
        llm.close()
    for want, got in zip(outs["float32"], outs["bfloat16"]):
        assert got.token_ids == want.token_ids
        for lw, lg in zip(want.logprobs, got.logprobs):
            (tw, pw), = lw.items()
            (tg, pg), = lg.items()
            assert tg == tw and abs(pg - pw) < 0.15


def test_one_decoder_over_two_caches_and_growing_batches():
    """The plain step's calls are built once per set of buffers: a decoder that alternates
    between two caches, and whose batch grows (new row buffers), gives each step exactly what
    a fresh decoder gives on a copy of the same cache."""
    cfg = tiny_config()
    model = random_model(cfg, seed=2).fuse_for_inference()
    g = torch.Generator().manual_seed(4)
    caches = []
    for seed in (0, 1):
        cache = HybridCache.allocate(cfg, 40, 8, 9)
        prompts = [torch.randint(0, cfg.vocab_size, (4 + 3 * i + seed,), generator=g).tolist()
                   for i in range(8)]
        _prefill(model, cache, [[1 + 4 * i + j for j in range(4)] for i in range(8)],
                 list(range(1, 9)), prompts)
        caches.append((cache, [len(p) for p in prompts]))
    shared = fused_decoder(model, caches[0][0])
    # the row inputs in buffers kept across calls, as the runner's RowInputs keeps them
    ctx_buf, slots_buf = torch.zeros(8, dtype=torch.long), torch.arange(1, 9)
    table_buf = torch.tensor([[1 + 4 * i + j for j in range(4)] for i in range(8)])
    for rows in (1, 1, 3, 8, 3):
        for cache, lens in caches:
            fresh_cache = _clone(cache)
            ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
            ctx_buf[:rows] = torch.tensor(lens[:rows])
            ctx, slots, table = ctx_buf[:rows], slots_buf[:rows], table_buf[:rows]
            got = shared(ids, ctx, slots, table, cache)
            want = fused_decoder(model, fresh_cache)(ids, ctx, slots, table, fresh_cache)
            assert torch.equal(got, want)
            for name in ("kda_states", "kda_conv", "mla_pages"):
                for a, b in zip(getattr(cache, name), getattr(fresh_cache, name)):
                    assert torch.equal(a, b), name
            for i in range(rows):
                lens[i] += 1


def test_plain_step_matches_torch_forward_and_refuses_unknown_ids():
    """The plain step (no capture, snapshots or drafts: fused_plain.py's built calls, its
    embedding gathered in C) against the torch forward; an id outside the vocabulary is
    refused before any block writes the cache."""
    cfg = tiny_config()
    model = random_model(cfg, seed=5).fuse_for_inference()
    cache = HybridCache.allocate(cfg, 32, 4, 4, num_snapshots=2)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (6, 11)]
    tables, slots = [list(range(1, 9)), list(range(9, 17))], [1, 2]
    _prefill(model, cache, tables, slots, prompts)
    ref_cache = _clone(cache)
    fused = fused_decoder(model, cache)
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2,), generator=g)
        _step(model, fused, ids, [len(p) + step for p in prompts], tables, slots, cache,
              ref_cache)
    before = [t.clone() for t in cache.kda_states]
    ctx = [len(p) + 3 for p in prompts]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused(torch.tensor([1, cfg.vocab_size]), torch.tensor(ctx), torch.tensor(slots),
              torch.tensor(tables), cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.kda_states, before))
