"""The fused CPU decode path over packed INT8/INT4 layers (decode_cpu.c's _q blocks, matrices
as descriptors: kdaserve/model/packed_args.py) against the oracle, the torch forward of the
model holding the dequantized weights: same logits to rounding, same greedy tokens; each row
the same bits alone or in a batch; through the engine, the same tokens as the torch decode."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import needs_kernels, require
from fused_cases import clone_cache as _clone
from fused_cases import prefill as _prefill
from tiny_models import random_model, tiny_config

from kdaserve.engine.llm import LLM
from kdaserve.model.batch import build_forward_batch
from kdaserve.model.fused_decode import FusedDecoder, fused_decoder, supports
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.loader import save_model
from kdaserve.model.quant_linear import QuantLinear
from kdaserve.model.quantize import quantize_model
from kdaserve.quant_config import WeightQuant
from kdaserve.request import SamplingParams

pytestmark = needs_kernels

CFG = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48,
       "kv_lora_rank": 32}
SCHEMES = [WeightQuant(8, 32), WeightQuant(4, 32), WeightQuant(4, 16, symmetric=False),
           WeightQuant(4, 32, ignore=("lm_head", "re:.*\\.b_proj$"))]
IDS = ["int8", "int4", "int4-asym", "int4-some-float"]


@pytest.fixture(autouse=True)
def _built():
    from kdaserve.ops.cpu_kernels import decode_block_kernels

    require(decode_block_kernels("q"), "csrc/decode_cpu.c (_q blocks)")


def _twin(q, cfg):
    """The float model of q's dequantized weights (the oracle)."""
    ref = random_model(cfg)
    state = {k: v for k, v in q.state_dict().items()
             if not k.rsplit(".", 1)[-1].startswith(("weight_", "experts_w"))}
    for name, mod in q.named_modules():
        if isinstance(mod, QuantLinear):
            state[f"{name}.weight"] = mod.dequantized()
        elif getattr(mod, "int_quant", None) is not None:
            for i, stack in enumerate(("experts_w13", "experts_w2")):
                state[f"{name}.{stack}"] = torch.stack(
                    [mod._expert(e, torch.float32)[i].clone() for e in range(mod.num_experts)])
    ref.load_state_dict(state, strict=True)
    return ref.fuse_for_inference()


@pytest.mark.parametrize("int_dot", ["0", "1"], ids=["fp32-decode", "int-dot"])
@pytest.mark.parametrize("wq", SCHEMES, ids=IDS)
def test_step_matches_the_dequantized_forward(wq, int_dot, monkeypatch):
    """The fp32 decode (KDASERVE_INT_DOT=0) against the float model of the dequantized
    weights; the integer dots (8-bit activations) against the quantized model's own torch
    forward, whose packed products take the same integer dots (cpu_int_linear.py)."""
    if int_dot == "1" and wq.ignore:
        pytest.skip("a float b_proj leaves the KDA input projections one dequantized fp32 "
                    "matrix in the fused blocks (fused_args.py), against the torch forward's "
                    "integer dots: the fp32-decode case covers it")
    monkeypatch.setenv("KDASERVE_INT_DOT", int_dot)
    cfg = tiny_config(**CFG)
    q = quantize_model(random_model(cfg, seed=2), wq)
    ref = _twin(q, cfg) if int_dot == "0" else None
    model = q.fuse_for_inference()
    ref = ref or model
    rows = 3
    cache = HybridCache.allocate(cfg, 64, 4, 8)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 14)]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(rows)]
    slots = [2 + i for i in range(rows)]
    _prefill(ref, cache, tables, slots, prompts)
    ref_cache = _clone(cache)
    fused = fused_decoder(model, cache)
    assert isinstance(fused, FusedDecoder) and supports(model, cache)
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * rows, ctx, num_decode=rows,
                                 conv_kernel=cfg.conv_kernel_size, chunk_size=ref.chunk_size,
                                 cache=ref_cache, block_tables=tables, state_slots=slots)
        with torch.inference_mode():
            want, _ = ref(ids, fb)
        got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache)
        # the same weights, sums in other orders (the packed products' fixed order)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert fused.still_valid()
    for name in ("kda_states", "mla_pages"):
        for a, b in zip(getattr(cache, name), getattr(ref_cache, name)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("int_dot", ["0", "1"], ids=["fp32-decode", "int-dot"])
@pytest.mark.parametrize("wq", SCHEMES[:2], ids=IDS[:2])
def test_rows_alone_equal_rows_together(wq, int_dot, monkeypatch):
    monkeypatch.setenv("KDASERVE_INT_DOT", int_dot)
    cfg = tiny_config(**CFG)
    model = quantize_model(random_model(cfg, seed=5), wq).fuse_for_inference()
    rows = 11
    cache = HybridCache.allocate(cfg, 4 * rows + 1, 4, rows + 1)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (3 + i % 7,), generator=g).tolist()
               for i in range(rows)]
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(rows)]
    slots = list(range(1, rows + 1))
    _prefill(model, cache, tables, slots, prompts)
    alone_cache = _clone(cache)
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


def test_engine_greedy_same_fused_or_not(monkeypatch, tmp_path):
    cfg = tiny_config(**CFG)
    save_model(random_model(cfg, seed=3), tmp_path)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 3, 17], [8] * 11, [1, 2, 3, 4, 5, 6])]
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("KDASERVE_FUSED_DECODE", mode)
        llm = LLM(str(tmp_path), max_num_seqs=4, block_size=4, quantization="int4",
                  quantization_group_size=16, num_threads=1, cache_memory=16 << 20)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert isinstance(llm.engine.runner._fused, FusedDecoder) == (mode == "1")
        llm.close()
    assert outs["0"] == outs["1"]


@pytest.mark.parametrize("bits", [8, 4])
def test_k3_step_matches_its_torch_forward(bits):
    """Kimi K3 (attention residuals, latent SiTU experts, gated MLA) with packed layers: the
    fused _q blocks against the same model's torch forward."""
    from k3_models import k3_raw, random_k3

    from kdaserve.model.registry import load_config
    from kdaserve.quant_config import from_scheme

    cfg = load_config(k3_raw())
    model = quantize_model(random_k3(cfg, seed=1), from_scheme(f"int{bits}", 32))
    with torch.no_grad():       # attention-residual pseudo-queries away from their zero init
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)
    model = model.fuse_for_inference()
    rows = 3
    cache = HybridCache.allocate(cfg, 64, 4, 8)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (n,), generator=g).tolist()
               for n in (9, 5, 14)]
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(rows)]
    slots = [2 + i for i in range(rows)]
    _prefill(model, cache, tables, slots, prompts)
    ref_cache = _clone(cache)
    fused = fused_decoder(model, cache)
    assert isinstance(fused, FusedDecoder) and fused.res is not None
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size - 1, (rows,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * rows, ctx, num_decode=rows,
                                 conv_kernel=cfg.conv_kernel_size, chunk_size=model.chunk_size,
                                 cache=ref_cache, block_tables=tables, state_slots=slots)
        with torch.inference_mode():
            want, _ = model(ids, fb)
        got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("heads", [3, 16])        # MLA: each head's dots, or heads as lanes
@pytest.mark.parametrize("wq", SCHEMES[:2], ids=IDS[:2])
def test_one_thread_or_two_the_same_bits(wq, heads, monkeypatch):
    """The packed products split their output tiles over the threads and the MoE block its
    experts, each output computed whole on one thread, and MLA attention splits a row's
    positions by its length alone: one thread and two give the same bits (the served engine
    moves its thread count with the free cores)."""
    monkeypatch.setenv("KDASERVE_INT_DOT", "1")
    cfg = tiny_config(**{**CFG, "moe_intermediate_size": 64, "num_attention_heads": heads})
    model = quantize_model(random_model(cfg, seed=7), wq).fuse_for_inference()
    rows = 3
    cache = HybridCache.allocate(cfg, 80, 16, 8)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
               for n in (9, 300, 140)]            # MLA: one range, three, two
    tables = [list(range(1 + 24 * i, 25 + 24 * i)) for i in range(rows)]
    slots = [2 + i for i in range(rows)]
    _prefill(model, cache, tables, slots, prompts)
    caches, logits = [], []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c = _clone(cache)
            fused = fused_decoder(model, c)
            ids = torch.tensor([5, 17, 3])
            for step in range(3):
                ctx = torch.tensor([len(p) + step for p in prompts])
                for n in (1, rows):           # a lone row (every expert's input the same)
                    out = fused(ids[:n], ctx[:n], torch.tensor(slots[:n]),
                                torch.tensor(tables[:n]), c)
                    logits.append(out)
                ids = out.argmax(-1)
            caches.append(c)
    finally:
        torch.set_num_threads(saved)
    half = len(logits) // 2
    for a, b in zip(logits[:half], logits[half:]):
        assert torch.equal(a, b)
    for name in ("kda_states", "kda_conv", "mla_pages"):
        for a, b in zip(getattr(caches[0], name), getattr(caches[1], name)):
            assert torch.equal(a, b), name
