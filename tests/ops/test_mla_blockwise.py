"""Blockwise MLA attention (online softmax over tiles of the page table, split-K decode) equals
the dense reference functions, and the model gives the same results through either path."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import require
from tiny_models import random_model, tiny_config

from kdaserve.model.batch import build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.ops import mla, online_softmax
from kdaserve.ops.mla import (
    mla_decode_absorbed,
    mla_decode_split_k,
    mla_prefill_attention,
    mla_prefill_blockwise,
)
from kdaserve.ops.online_softmax import attention_lse, gather_blocks, merge_partials, paged_tiles

H, N, R, DC, VD, BS = 3, 8, 4, 12, 6, 4


@pytest.fixture(params=["fused", "torch"])
def backend(request, monkeypatch):
    """Both implementations of attention_lse: the fused CPU kernel and the plain torch one."""
    if request.param == "torch":
        monkeypatch.setattr(online_softmax, "_FLASH_CPU", None)
    elif online_softmax._FLASH_CPU is None:
        pytest.skip("no fused CPU attention kernel in this torch")
    return request.param


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles and splits of a few blocks, so every path (many tiles, ragged tails, rows that
    run out of keys early) runs on small inputs."""
    monkeypatch.setattr(mla, "PREFILL_TILE_BYTES", 1)
    monkeypatch.setattr(mla, "DECODE_TILE_BYTES", 1)
    monkeypatch.setattr(mla, "DECODE_SPLIT_TOKENS", 2 * BS)
    monkeypatch.setattr(mla, "DECODE_KERNEL_SPLIT_TOKENS", 2 * BS)


def _weights(g: torch.Generator) -> torch.Tensor:
    return torch.randn(H, N + VD, DC, generator=g) / DC ** 0.5             # [H, N+Vd, Dc]


def _expand(w: torch.Tensor):
    def expand(lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, l_, _ = lat.shape
        kv = torch.einsum("blc,hdc->blhd", lat[..., :DC], w)
        k = torch.cat([kv[..., :N], lat[..., DC:].unsqueeze(2).expand(b, l_, H, R)], -1)
        return k, kv[..., N:]
    return expand


def _paged(lens: list[int], g: torch.Generator, spare: int = 3):
    """Random pages, and a shuffled block table per sequence: pages [NB,bs,D], tables [B,W]."""
    need = [-(-n // BS) for n in lens]
    pages = torch.randn(sum(need) + spare, BS, DC + R, generator=g)
    perm = torch.randperm(pages.shape[0], generator=g).tolist()
    width, at, rows = max(need), 0, []
    for n in need:
        rows.append(perm[at:at + n] + [0] * (width - n))
        at += n
    return pages, torch.tensor(rows)


def _rows(pages: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n latents of one sequence: [n, D]."""
    return gather_blocks(pages, table[None])[0, :n]


def test_attention_lse_matches_softmax(backend):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, H, 5, 7, generator=g), torch.randn(2, H, 9, 7, generator=g)
    v = torch.randn(2, H, 9, 4, generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.4
    mask[1] = False                                    # a row that sees no key at all
    s = torch.einsum("bhqe,bhke->bhqk", q, k) * 0.3
    o, lse = attention_lse(q, k, v, 0.3, key_mask=mask)
    ref = s.masked_fill(~mask[:, None, None], float("-inf"))
    torch.testing.assert_close(lse[0], ref[0].logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o[0], ref[0].softmax(-1) @ v[0], atol=1e-5, rtol=1e-5)
    assert bool((lse[1] == float("-inf")).all()) and bool((o[1] == 0).all())
    o, lse = attention_lse(q, k[:, :, :5], v[:, :, :5], 0.3, causal=True)
    causal = s[..., :5].masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(o, causal.softmax(-1) @ v[:, :, :5], atol=1e-5, rtol=1e-5)


def test_merging_partials_is_softmax_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, H, 4, 6, generator=g), torch.randn(1, H, 10, 6, generator=g)
    v = torch.randn(1, H, 10, 5, generator=g)
    whole, lse = attention_lse(q, k, v, 0.5)
    parts = [attention_lse(q, k[:, :, a:z], v[:, :, a:z], 0.5) for a, z in ((0, 3), (3, 10))]
    empty = (torch.zeros_like(whole), torch.full_like(lse, float("-inf")))
    o, l_ = merge_partials(torch.stack([p[0] for p in parts] + [empty[0]]),
                           torch.stack([p[1] for p in parts] + [empty[1]]), 0)
    torch.testing.assert_close(o, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l_, lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", ["one", "many"])
def test_prefill_blockwise_equals_dense_reference(backend, tiles, request):
    if tiles == "many":
        request.getfixturevalue("small_tiles")
    g = torch.Generator().manual_seed(2)
    w = _weights(g)
    ctx, lens = [37, 0, 101, 5], [20, 7, 13, 1]
    pages, tables = _paged([c + n for c, n in zip(ctx, lens)], g)
    q = torch.randn(4, max(lens), H, N + R, generator=g)
    chunk = torch.zeros(4, max(lens), DC + R)
    for b in range(4):
        chunk[b, : lens[b]] = _rows(pages, tables[b], ctx[b] + lens[b])[ctx[b]:]
    out = mla_prefill_blockwise(q, chunk, _expand(w), 0.3, pages=pages, ctx_blocks=tables,
                                ctx_lens=torch.tensor(ctx))
    for b in range(4):
        total = ctx[b] + lens[b]
        k, v = _expand(w)(_rows(pages, tables[b], total)[None])
        mask = torch.arange(total)[None] <= torch.arange(ctx[b], total)[:, None]
        ref = mla_prefill_attention(q[b:b + 1, : lens[b]], k, v, mask[None, None], 0.3)
        torch.testing.assert_close(out[b, : lens[b]], ref[0], atol=1e-5, rtol=1e-4)


def test_prefill_blockwise_without_cache_is_causal_attention(backend):
    g = torch.Generator().manual_seed(3)
    w = _weights(g)
    q, lat = torch.randn(2, 9, H, N + R, generator=g), torch.randn(2, 9, DC + R, generator=g)
    out = mla_prefill_blockwise(q, lat, _expand(w), 0.4)
    k, v = _expand(w)(lat)
    torch.testing.assert_close(out, mla_prefill_attention(q, k, v, None, 0.4), atol=1e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("decode", ["kernel", "torch"])
@pytest.mark.parametrize("tiles", ["one", "many"])
def test_split_k_decode_equals_absorbed_reference(backend, tiles, decode, request,
                                                  monkeypatch):
    """Both split-K decodes: the compiled paged kernel (csrc/mla_cpu.c) and the torch one."""
    if tiles == "many":
        request.getfixturevalue("small_tiles")
    if decode == "torch":
        monkeypatch.setattr(mla, "_paged_decode_kernel", lambda: None)
    else:
        require(mla._paged_decode_kernel(), "csrc/mla_cpu.c")
    g = torch.Generator().manual_seed(4)
    w = _weights(g)
    lens = [1, 37, 200, 65, 8]
    pages, tables = _paged(lens, g)
    q = torch.randn(len(lens), H, N + R, generator=g)
    out = mla_decode_split_k(q[..., :N], q[..., N:], pages, tables, torch.tensor(lens),
                             w[:, :N], w[:, N:], 0.3)
    ctx = gather_blocks(pages, tables)
    mask = torch.arange(ctx.shape[1])[None] < torch.tensor(lens)[:, None]
    ref = mla_decode_absorbed(q[..., :N], q[..., N:], ctx, mask, w[:, :N], w[:, N:], 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_consecutive_blocks_are_read_in_place():
    pages = torch.randn(20, BS, 5)
    table = torch.tensor([[3, 4, 5, 9, 10, 11, 12, 0]])         # two runs, then padding
    tiles = list(paged_tiles(pages, table, [26], 3 * BS))
    assert [(t.t0, t.t1) for t in tiles] == [(0, 12), (12, 24), (24, 28)]
    assert tiles[0].ctx.data_ptr() == pages[3].data_ptr()
    assert tiles[1].ctx.data_ptr() == pages[9].data_ptr()
    torch.testing.assert_close(torch.cat([t.ctx[0] for t in tiles]),
                               gather_blocks(pages, table[:, :7])[0])
    scattered = torch.tensor([[7, 2, 15, 4, 11, 1, 18, 9, 3]])
    tiles = list(paged_tiles(pages, scattered, [35], 4 * BS))   # too fragmented: gathered
    assert [(t.t0, t.t1) for t in tiles] == [(0, 16), (16, 32), (32, 36)]
    torch.testing.assert_close(torch.cat([t.ctx[0] for t in tiles]),
                               gather_blocks(pages, scattered)[0])


def test_tiles_bound_the_keys_read_over_all_rows():
    pages = torch.randn(40, BS, 5)
    table, lens = torch.arange(1, 37).view(4, 9), [36, 5, 9, 2]
    tiles = list(paged_tiles(pages, table, lens, 8 * BS))
    assert max(t.ctx.shape[0] * t.ctx.shape[1] for t in tiles) <= 8 * BS
    for i, n in enumerate(lens):
        mine = [t.ctx[t.rows.tolist().index(i) if t.rows is not None else i] for t in tiles
                if t.rows is None or i in t.rows.tolist()]
        torch.testing.assert_close(torch.cat(mine)[:n], gather_blocks(pages, table[i:i + 1])[0, :n])


@pytest.mark.parametrize("chunk", [3, 16])
def test_model_through_blockwise_paths_equals_full_forward(monkeypatch, small_tiles, chunk):
    """Dense limits at zero: every MLA call of a cached chunked prefill and of the decode steps
    goes blockwise; logits match one full-sequence forward through the dense reference."""
    model = random_model(tiny_config(), seed=5)
    seq = torch.randint(0, 64, (45,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.forward_dense(seq[None])[0]
        monkeypatch.setattr(mla, "DENSE_MAX_SCORES", 0)
        monkeypatch.setattr(mla, "DENSE_MAX_DECODE_KEYS", 0)
        cache = HybridCache.allocate(model.config, 16, BS, 2)
        table = [[i for i in range(15, 3, -1)]]                    # non-consecutive blocks
        got, pos = [], 0
        while pos < len(seq):
            n = 1 if pos >= 40 else min(chunk, 40 - pos)
            fb = build_forward_batch([n], [pos], num_decode=int(pos >= 40), cache=cache,
                                     conv_kernel=4, chunk_size=model.chunk_size,
                                     block_tables=table, state_slots=[1])
            assert fb.mla.decode_blockwise or fb.mla.prefill_blockwise
            logits, _ = model(seq[pos:pos + n], fb)
            got.append(logits)
            pos += n
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
