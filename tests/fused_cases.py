"""Shared by the fused decode path's tests (tests/model/test_fused_decode*.py): prompts
prefilled through the torch forward into a cache, and copies of a cache to step a reference
beside the fused path."""

from __future__ import annotations

import torch

from kdaserve.model.batch import build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache


def prefill(model, cache: HybridCache, tables, slots, prompts) -> None:
    fb = build_forward_batch([len(p) for p in prompts], [0] * len(prompts),
                             conv_kernel=model.config.conv_kernel_size,
                             chunk_size=model.chunk_size, cache=cache, block_tables=tables,
                             state_slots=slots)
    with torch.inference_mode():
        model(torch.tensor([t for p in prompts for t in p]), fb)


def clone_cache(cache: HybridCache, dtype: torch.dtype | None = None) -> HybridCache:
    """A copy; with `dtype`, its MLA pages and conv windows in it (KDA states stay fp32)."""
    out = HybridCache(**{f: ([t.clone() for t in v] if isinstance(v, list)
                             else v.clone() if isinstance(v, torch.Tensor) else v)
                         for f, v in vars(cache).items()})
    if dtype is not None:
        for name in ("mla_pages", "kda_conv", "snap_conv"):
            setattr(out, name, [t.to(dtype) for t in getattr(out, name)])
    return out


def round_to_bf16(cache: HybridCache) -> None:
    """What a bf16 cache keeps of the fp32 MLA pages and conv windows, in place."""
    for t in cache.mla_pages + cache.kda_conv:
        t.copy_(t.to(torch.bfloat16))


def step_against_forward(model, fused, ids: torch.Tensor, ctx: list[int], tables, slots,
                         cache: HybridCache, ref_cache: HybridCache) -> torch.Tensor:
    """One decode step of the rows through the fused decoder (over `cache`) and through the
    torch forward (over `ref_cache`): the same logits to rounding, the same greedy tokens."""
    fb = build_forward_batch([1] * len(ctx), ctx, num_decode=len(ctx),
                             conv_kernel=model.config.conv_kernel_size,
                             chunk_size=model.chunk_size, cache=ref_cache, block_tables=tables,
                             state_slots=slots)
    with torch.inference_mode():
        want, _ = model(ids, fb)
    got = fused(ids, torch.tensor(ctx), torch.tensor(slots), torch.tensor(tables), cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    return got
