"""Fixed inputs through the compiled kernels' Python wrappers, for the bitwise comparison of
two builds (tests/ops/test_aarch64_qemu.py): each case returns what the kernels wrote, to be
run once routed to this machine's build and once to another's."""

from __future__ import annotations

import test_cpu_kernels
import test_moe_kernel_k3
import torch

from kdaserve.ops import mla


def _linear() -> list[torch.Tensor]:
    from kdaserve.ops.cpu_linear import k_major_weight, linear

    g = torch.Generator().manual_seed(0)
    w = k_major_weight(torch.randn(200, 72, generator=g))      # wide, 6-row and 16-col tiles
    return [linear(torch.randn(rows, 72, generator=g), w) for rows in (1, 2, 7, 13)]


def _kda() -> list[torch.Tensor]:
    from kdaserve.ops import cpu_kernels

    out = []
    for B, L, H, D in ((2, 3, 2, 64), (1, 2, 1, 128), (3, 2, 2, 16)):
        q, k, v, gate, beta = test_cpu_kernels._inputs(B, L, H, D, seed=D)
        store = torch.randn(B + 1, H, D, D, generator=torch.Generator().manual_seed(1)) * 0.1
        kept = torch.empty(B, L, H, D, D)
        o = cpu_kernels.kda_recurrent_slots_kernel()(store, torch.arange(1, B + 1), q, k, v,
                                                      gate, beta, kept)
        out += [o, store, kept]
    g = torch.Generator().manual_seed(2)
    H, D, W, T = 2, 16, 3, 9
    pre, fraw = torch.randn(T, 3 * H * D, generator=g), torch.randn(T, H * D, generator=g)
    prepared = cpu_kernels.kda_prepare_kernel()(
        pre, torch.randn(2, W, 3 * H * D, generator=g), torch.tensor([0, 4, T]),
        torch.randn(W + 1, 3 * H * D, generator=g), fraw, torch.randn(H * D, generator=g),
        torch.rand(H, generator=g), torch.randn(T, H, generator=g), H, D ** -0.5)
    return out + list(prepared)


def _moe() -> list[torch.Tensor]:
    from kdaserve.ops.mxfp4 import quantize_mxfp4

    t = test_moe_kernel_k3
    token, offsets, slot_w, _, _ = t._routing(5, seed=3)
    x = torch.randn(5, t.H, generator=torch.Generator().manual_seed(4))
    w1, w3, w2 = t._fp32_weights(5)
    act = t.ACTS["situ_lb"]
    fp32 = moe_kernel_fn("moe_experts_kernel")(
        x, token, offsets, slot_w, torch.cat([w1, w3], 1).transpose(1, 2).contiguous(),
        w2.transpose(1, 2).contiguous(), torch.zeros_like(x), act)
    (q13, s13), (q2, s2) = quantize_mxfp4(torch.cat([w1, w3], 1)), quantize_mxfp4(w2)
    mx = moe_kernel_fn("moe_experts_mxfp4_kernel")(x, token, offsets, slot_w, q13, s13, q2,
                                                     s2, torch.zeros_like(x), act)
    return [fp32, mx]


def moe_kernel_fn(name: str):
    from kdaserve.ops import moe_kernel

    return getattr(moe_kernel, name)()


def _mla() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    pages = torch.randn(12, 16, 40, generator=g)
    blocks = torch.randperm(12, generator=g)[:9].reshape(3, 3)
    qa = torch.randn(3, 4, 40, generator=g) * 0.2
    return [mla._paged_decode_kernel()(pages, blocks, torch.tensor([1, 29, 48]), qa)]


def _sample() -> list[torch.Tensor]:
    from kdaserve.ops.sample_kernel import sample_rows_kernel

    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(7)) * 3
    return [sample_rows_kernel()(logits.clone(), [0.0, 0.7, 1.0, 0.9, 1.2, 0.5],
                                 [500, 20, 500, 500, 3, 50], [1.0, 0.9, 1.0, 0.95, 1.0, 0.5],
                                 [0.0, 0.0, 0.05, 0.0, 0.0, 0.01],
                                 [0.1, 0.5, 0.9, 0.3, 0.7, 0.2], [(1.3, 0.4, 0.2)] * 6,
                                 [([1, 2, 3], [4, 5, 5])] * 6)]


def _fused() -> list[torch.Tensor]:
    """Three decode steps of three rows through the fused blocks of a tiny model (fp32
    weights, experts transposed; bf16, experts as the checkpoint lays them out; fp32 with 16
    MLA heads): logits and every cache tensor."""
    from fused_cases import prefill
    from tiny_models import random_model, tiny_config
    from torch import nn

    from kdaserve.model.fused_decode import fused_decoder
    from kdaserve.model.hybrid_cache import HybridCache
    from kdaserve.model.moe import SparseMoE

    out = []
    # 16 MLA heads: their scores with the heads as lanes (csrc/mla_attend.h mla_scores16)
    for dtype, over in ((torch.float32, {}), (torch.bfloat16, {}),
                        (torch.float32, {"num_attention_heads": 16, "kv_lora_rank": 80})):
        cfg = tiny_config(**over)
        model = random_model(cfg, seed=3).fuse_for_inference()
        cache = HybridCache.allocate(cfg, 64, 4, 8, num_snapshots=4)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 14)]
        tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)]
        prefill(model, cache, tables, [2, 3, 4], prompts)
        if dtype == torch.bfloat16:        # and the experts in the checkpoint's layout
            model = model.to_dtype(dtype)
            for layer in model.model.layers:
                if isinstance(layer.ffn, SparseMoE):
                    for name in ("experts_w13", "experts_w2"):
                        w = getattr(layer.ffn, name).detach().contiguous()
                        setattr(layer.ffn, name, nn.Parameter(w, requires_grad=False))
            for name in ("mla_pages", "kda_conv", "snap_conv"):
                setattr(cache, name, [t.to(dtype) for t in getattr(cache, name)])
        fused = fused_decoder(model, cache)
        assert fused.wdtype == dtype
        for step in range(3):
            ids = torch.randint(0, cfg.vocab_size, (3,), generator=g)
            ctx = [len(p) + step for p in prompts]
            out.append(fused(ids, torch.tensor(ctx), torch.tensor([2, 3, 4]),
                             torch.tensor(tables), cache))
        out += [t.float() for t in cache.kda_states + cache.kda_conv + cache.mla_pages]
    return out


def _int_dots() -> list[torch.Tensor]:
    """The integer dots over packed INT8/INT4 rows (csrc/int_dot.h: AVX2, NEON, portable C
    are one definition, fused multiply-adds included), a lone row and a few, with and
    without zero points, INT4 in groups of half a unit and of two units."""
    from kdaserve.ops.cpu_int_linear import rows_product
    from kdaserve.ops.int_quant import quantize

    g = torch.Generator().manual_seed(8)
    out = []
    for bits, n, k, group, symmetric in ((4, 37, 128, 32, True), (4, 20, 256, 128, False),
                                         (8, 19, 96, 32, False), (8, 33, 128, 64, True)):
        packed, scale, zero = quantize(torch.randn(n, k, generator=g), bits, group, symmetric)
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=g)
            out.append(rows_product(x, packed, scale, zero, bits, group, n, act8=True))
    return out


CASES = {"row_products": _linear, "kda": _kda, "moe": _moe, "mla_paged": _mla,
         "sampling": _sample, "fused_decode": _fused, "int_dots": _int_dots}
