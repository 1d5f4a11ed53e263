"""The fused CPU decode path (kdaserve.model.fused_decode) against the model's torch forward,
its reference: same logits to rounding, same cache contents, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from kdaserve.engine.llm import LLM
from kdaserve.model.batch import HybridCache, build_forward_batch
from kdaserve.model.fused_decode import FusedDecoder, fused_decoder, supports
from kdaserve.request import SamplingParams
from tiny_models import random_model, tiny_config

pytestmark = pytest.mark.skipif(
    __import__("kdaserve.ops.cpu_kernels", fromlist=["x"]).decode_block_kernels() is None,
    reason="no C compiler: the fused decode path is off")


def _prefill(model, cache, tables, slots, prompts):
    fb = build_forward_batch([len(p) for p in prompts], [0] * len(prompts),
                             conv_kernel=model.config.conv_kernel_size,
                             chunk_size=model.chunk_size, cache=cache, block_tables=tables,
                             state_slots=slots)
    with torch.inference_mode():
        model(torch.tensor([t for p in prompts for t in p]), fb)


def _clone(cache: HybridCache) -> HybridCache:
    return HybridCache(**{f: ([t.clone() for t in v] if isinstance(v, list)
                              else v.clone() if isinstance(v, torch.Tensor) else v)
                          for f, v in vars(cache).items()})


@pytest.mark.parametrize("gate", ["low_rank", "full_rank", "no_shared"])
@pytest.mark.parametrize("rows", [1, 3])
def test_step_matches_torch_forward(gate, rows):
    over = {}
    if gate == "full_rank":
        over["linear_attn_config"] = {"kda_layers": [1, 2, 4], "full_attn_layers": [3],
                                      "num_heads": 2, "head_dim": 8,
                                      "short_conv_kernel_size": 4, "use_full_rank_gate": True}
    if gate == "no_shared":
        over["num_shared_experts"] = 0
    cfg = tiny_config(**over)
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
    assert isinstance(fused, FusedDecoder)
    for step in range(4):
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        ctx = [len(p) + step for p in prompts]
        fb = build_forward_batch([1] * rows, ctx, num_decode=rows,
                                 conv_kernel=cfg.conv_kernel_size, chunk_size=model.chunk_size,
                                 cache=ref_cache, block_tables=tables, state_slots=slots,
                                 snapshots=[(0, ctx[0] + 1, step)])
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


def test_not_for_other_dtypes_or_rope():
    cfg = tiny_config()
    cache = HybridCache.allocate(cfg, 8, 4, 2)
    assert supports(random_model(cfg), cache)
    assert not supports(random_model(cfg).to_dtype(torch.bfloat16), cache)
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
