"""MLA pages and masks (kdaserve/model/layout/mla.py) against per-token loops."""

from __future__ import annotations

import torch

from kdaserve.model.layout.mla import block_table, mla_layout
from kdaserve.model.layout.rows import PackedRows
from kdaserve.ops import mla as mla_ops

CPU = torch.device("cpu")
BS = 4


def test_slot_mapping_and_decode_context():
    lens, ctx, nd = [1, 3, 2, 5], [6, 9, 3, 0], 2
    tables = [[7, 2], [1, 5, 8], [3, 4], [6, 9]]
    rows = PackedRows.build(lens, ctx, nd, CPU)
    lay = mla_layout(rows, lens, ctx, BS, tables)
    t = 0
    for b, (n, c) in enumerate(zip(lens, ctx)):
        for j in range(n):
            p = c + j
            assert int(lay.slot_mapping[t]) == tables[b][p // BS] * BS + p % BS
            t += 1
    td = sum(lens[:nd])
    assert lay.decode_kv_lens.tolist() == [7, 10, 11, 12]
    wd = lay.decode_ctx_blocks.shape[1]
    assert wd == 3                                     # ceil(12 / 4)
    assert lay.decode_ctx_blocks.tolist()[0] == [7, 2, 0]   # right-padded with block 0
    assert lay.decode_ctx_mask.shape == (td, wd * BS)
    assert lay.decode_ctx_mask.sum(1).tolist() == lay.decode_kv_lens.tolist()


def test_prefill_mask_is_causal_with_offset():
    lens, ctx = [3, 2], [5, 0]
    tables = [[4, 6], [1]]
    rows = PackedRows.build(lens, ctx, 0, CPU)
    lay = mla_layout(rows, lens, ctx, BS, tables)
    assert not lay.prefill_causal and lay.prefill_mask is not None
    mask = lay.prefill_mask[:, 0]                     # [Bp, Qp, Lp]
    for b in range(2):
        for q in range(max(lens)):
            if q < lens[b]:
                want = [k <= ctx[b] + q for k in range(mask.shape[2])]
            else:                                     # a padded query sees key 0 alone
                want = [k == 0 for k in range(mask.shape[2])]
            assert mask[b, q].tolist() == want
    assert lay.prefill_ctx_lens.tolist() == ctx


def test_fresh_prompts_of_one_length_build_no_mask():
    lens = [5, 5]
    rows = PackedRows.build(lens, [0, 0], 0, CPU)
    lay = mla_layout(rows, lens, [0, 0], BS, [[1, 2], [3, 4]])
    assert lay.prefill_causal and lay.prefill_mask is None


def test_no_cache_layouts():
    rows = PackedRows.build([4, 4], [0, 0], 0, CPU)
    lay = mla_layout(rows, [4, 4], [0, 0], None, None)
    assert lay.slot_mapping is None and lay.prefill_mask is None     # plainly causal
    rows = PackedRows.build([4, 2], [0, 0], 0, CPU)
    lay = mla_layout(rows, [4, 2], [0, 0], None, None)
    assert lay.prefill_mask[1, 0, 1].tolist() == [True, True, False, False]
    assert lay.prefill_mask[1, 0, 3].tolist() == [True, False, False, False]   # padded query


def test_past_the_dense_limits_attention_goes_blockwise(monkeypatch):
    monkeypatch.setattr(mla_ops, "DENSE_MAX_DECODE_KEYS", 8)
    monkeypatch.setattr(mla_ops, "DENSE_MAX_SCORES", 8)
    lens, ctx = [1, 3], [9, 2]
    rows = PackedRows.build(lens, ctx, 1, CPU)
    lay = mla_layout(rows, lens, ctx, BS, [[1, 2, 3], [4, 5]])
    assert lay.decode_blockwise and lay.decode_ctx_mask is None
    assert lay.prefill_blockwise and lay.prefill_mask is None


def test_block_table_pads_rows_with_block_zero():
    assert block_table([[3, 1], [], [5]], CPU).tolist() == [[3, 1], [0, 0], [5, 0]]
