"""The fused CPU decode path on Kimi K3's blocks (block attention-residuals, SiTU, latent MoE
with its norm, gated MLA with a query LoRA, full-rank KDA gate with a decay lower bound)
against the K3 model's torch forward, its reference: same logits and captured streams to
rounding, same cache, same greedy tokens; and through the engine on the bundled K3 demo."""

from __future__ import annotations

import copy

import pytest
import torch
from compiled_kernels import needs_kernels, require
from fused_cases import clone_cache as _clone
from fused_cases import prefill as _prefill
from fused_cases import round_to_bf16 as _round_to_bf16
from k3_models import k3_raw, random_k3

from kdaserve.assets import default_model_path
from kdaserve.engine.llm import LLM
from kdaserve.model.batch import build_forward_batch
from kdaserve.model.layout.snapshots import SnapshotAt
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.fused_decode import FusedDecoder, Kept, fused_decoder, supports
from kdaserve.model.moe import SparseMoE
from kdaserve.model.registry import load_config
from kdaserve.request import SamplingParams

pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _built():
    from kdaserve.ops.cpu_kernels import decode_block_kernels

    require(decode_block_kernels(), "csrc/decode_cpu.c")


def _model(seed: int, **over):
    cfg = load_config(k3_raw(**over))
    model = random_k3(cfg, seed).fuse_for_inference()
    with torch.no_grad():       # attention-residual pseudo-queries away from their zero init
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)
    return cfg, model


def _setup(cfg, model, rows, seed):
    cache = HybridCache.allocate(cfg, 64, 4, 8, num_snapshots=4)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (n,), generator=g).tolist()
               for n in (9, 5, 14)[:rows]]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(rows)]
    slots = [2 + i for i in range(rows)]
    _prefill(model, cache, tables, slots, prompts)
    return cache, g, prompts, tables, slots


@pytest.mark.parametrize("variant", ["k3", "plain_mla_no_latent_norm", "no_attn_res"])
@pytest.mark.parametrize("rows", [1, 3])
def test_k3_step_matches_torch_forward(variant, rows):
    over = {"k3": {},
            "plain_mla_no_latent_norm": {"q_lora_rank": None, "mla_use_output_gate": False,
                                         "latent_moe_use_norm": False},
            "no_attn_res": {"attn_res_block_size": None}}[variant]
    cfg, model = _model(rows, **over)
    assert supports(model, HybridCache.allocate(cfg, 8, 4, 2))
    cache, g, prompts, tables, slots = _setup(cfg, model, rows, rows)
    ref_cache = _clone(cache)
    fused = fused_decoder(model, cache)
    assert isinstance(fused, FusedDecoder)
    assert (fused.res is not None) == (variant != "no_attn_res")
    moe = [ly.ffn for ly in model.model.layers if isinstance(ly.ffn, SparseMoE)]
    assert moe and all(m.is_latent and m.act.kind == "situ" for m in moe)
    for step in range(4):
        ids = torch.randint(0, cfg.vocab_size - 1, (rows,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * rows, ctx, num_decode=rows,
                                 conv_kernel=cfg.conv_kernel_size, chunk_size=model.chunk_size,
                                 cache=ref_cache, block_tables=tables, state_slots=slots,
                                 snapshots=[SnapshotAt(0, ctx[0] + 1, step)])
        with torch.inference_mode():
            want, want_hidden = model(ids, fb, capture_layers=(0, 3))
        hidden: list[torch.Tensor] = []
        got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache,
                    snapshots=[(0, step)], capture=(0, 3), captured=hidden)
        # SiTU's tanh is a polynomial in the blocks (ops/csrc/fastmath.h): 5e-4 on logits
        # of scale ~1-10 (measured up to 1.7e-4)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-4)
        assert len(hidden) == 2           # the draft's context: P after those layers
        # the projections sum over K in one running sum (row_products.h matmat_t), the torch
        # forward's mm in blocks: up to 1.5e-4 apart on hidden states of scale ~1 (measured)
        for h, w in zip(hidden, want_hidden):
            torch.testing.assert_close(h, w, rtol=1e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # four steps of a random 5-layer model carry the logits' rounding into the cache
    for name in ("kda_states", "kda_conv", "mla_pages", "snap_states", "snap_conv"):
        for a, b in zip(getattr(cache, name), getattr(ref_cache, name)):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_k3_verify_rows_and_thread_split():
    """A token and its 3 drafts sharing a slot beside a plain row match the torch verify
    forward (logits, states kept after each position); 5 plain rows split over 2 threads
    give each row exactly what it gets alone."""
    cfg, model = _model(11)
    cache, g, prompts, tables, slots = _setup(cfg, model, 2, 4)
    ref_cache = _clone(cache)
    lens, ctx = [4, 1], [len(p) for p in prompts]
    ids = torch.randint(0, cfg.vocab_size - 1, (sum(lens),), generator=g)
    fb = build_forward_batch(lens, ctx, num_decode=2, conv_kernel=cfg.conv_kernel_size,
                             chunk_size=model.chunk_size, cache=ref_cache, block_tables=tables,
                             state_slots=slots, logits_indices=list(range(sum(lens))))
    with torch.inference_mode():
        want, _ = model(ids, fb)
    fused = fused_decoder(model, cache)
    kept = Kept.allocate(cache, sum(lens))
    positions = torch.tensor([ctx[0] + j for j in range(4)] + [ctx[1]])
    got = fused(ids, positions, torch.tensor([slots[0]] * 4 + [slots[1]]),
                torch.tensor([tables[0]] * 4 + [tables[1]]), cache, kept=kept)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-4)
    for i in range(len(cache.kda_states)):
        for j in range(4):
            torch.testing.assert_close(kept.states[i][j], fb.out.decode_states[i][0, j],
                                       rtol=1e-4, atol=1e-4)

    rows = 5
    cache = HybridCache.allocate(cfg, 4 * rows + 1, 4, rows + 1)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (3 + i,), generator=g).tolist()
               for i in range(rows)]
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(rows)]
    _prefill(model, cache, tables, list(range(1, rows + 1)), prompts)
    alone_cache = _clone(cache)
    fused = fused_decoder(model, cache)
    ids = torch.randint(0, cfg.vocab_size - 1, (rows,), generator=g)
    ctx_t, table, slot_t = (torch.tensor([len(p) for p in prompts]), torch.tensor(tables),
                            torch.arange(1, rows + 1))
    together = fused(ids, ctx_t, slot_t, table, cache, parts=2)
    alone = torch.cat([fused(ids[i:i + 1], ctx_t[i:i + 1], slot_t[i:i + 1], table[i:i + 1],
                             alone_cache) for i in range(rows)])
    assert torch.equal(together, alone)


def test_k3_bf16_step_matches_fp32_forward_of_the_rounded_weights():
    cfg, model = _model(7)
    model = model.to_dtype(torch.bfloat16)
    ref_model = copy.deepcopy(model).to_dtype(torch.float32)
    ref_cache, g, prompts, tables, slots = _setup(cfg, ref_model, 3, 7)
    _round_to_bf16(ref_cache)
    cache = _clone(ref_cache, torch.bfloat16)
    fused = fused_decoder(model, cache)
    assert isinstance(fused, FusedDecoder) and fused.wdtype == torch.bfloat16
    for step in range(4):
        ids = torch.randint(0, cfg.vocab_size - 1, (3,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * 3, ctx, num_decode=3, conv_kernel=cfg.conv_kernel_size,
                                 chunk_size=model.chunk_size, cache=ref_cache,
                                 block_tables=tables, state_slots=slots)
        with torch.inference_mode():
            want, _ = ref_model(ids, fb)
        _round_to_bf16(ref_cache)
        got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_not_for_mxfp4_experts():
    cfg = load_config(k3_raw(mxfp4=True))
    assert not supports(random_k3(cfg), HybridCache.allocate(cfg, 8, 4, 2))


def test_engine_k3_demo_greedy_same_with_and_without(monkeypatch):
    """The bundled K3 demo through the engine: fused and torch decode give the same greedy
    tokens, one stream and three at once."""
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["The weather today is", "ROMEO:", "What is in the image?"]
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("KDASERVE_FUSED_DECODE", mode)
        llm = LLM(str(default_model_path()), max_num_seqs=4)
        single = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                  for p in prompts]
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert isinstance(llm.engine.runner._fused, FusedDecoder) == (mode == "1")
        outs[mode] = (single, batch)
        llm.close()
    assert outs["0"] == outs["1"]
    assert outs["1"][0] == outs["1"][1]


def test_long_context_rows_split_over_spans_match_torch():
    """Rows of 5,000 and 2,100 cached positions: the fused MLA attention splits each into spans
    of 2,048 (each latent read once for all heads, partial softmax states merged); logits
    match the torch forward's paged decode, and a short row beside them is unchanged."""
    from tiny_models import random_model, tiny_config

    cfg = tiny_config(num_attention_heads=4, kv_lora_rank=16)
    model = random_model(cfg, seed=3).fuse_for_inference()
    bs, lens = 16, (5000, 2100, 7)
    per = [-(-(n + 2) // bs) for n in lens]
    cache = HybridCache.allocate(cfg, sum(per) + 1, bs, 4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    starts = [1 + sum(per[:i]) for i in range(3)]
    tables = [list(range(s, s + p)) for s, p in zip(starts, per)]
    width = max(per)
    tables = [t + [0] * (width - len(t)) for t in tables]
    slots = [1, 2, 3]
    for p, t, sl in zip(prompts, tables, slots):
        _prefill(model, cache, [t], [sl], [p])
    ref_cache = _clone(cache)
    ids = torch.randint(0, cfg.vocab_size, (3,), generator=g)
    fb = build_forward_batch([1] * 3, list(lens), num_decode=3, conv_kernel=cfg.conv_kernel_size,
                             chunk_size=model.chunk_size, cache=ref_cache, block_tables=tables,
                             state_slots=slots)
    with torch.inference_mode():
        want, _ = model(ids, fb)
    got = fused_decoder(model, cache)(ids, torch.tensor(lens), torch.tensor(slots),
                                      torch.tensor(tables), cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
