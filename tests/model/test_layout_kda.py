"""KDA rows and conv windows (kdaserve/model/layout/kda.py): the padded layouts against
per-token loops, and the chunk alignment that makes block-boundary states chunk-end states."""

from __future__ import annotations

import torch

from kdaserve.model.layout.kda import conv_layout, decode_layout, kda_layout, prefill_padding
from kdaserve.model.layout.rows import ConvRows, PackedRows

CPU = torch.device("cpu")
KM1, C = 3, 8


def _setup(lens, ctx, nd):
    rows = PackedRows.build(lens, ctx, nd, CPU)
    return rows, ConvRows(len(lens), KM1, rows.num_tokens)


def test_conv_groups_read_window_then_tokens_then_zero():
    lens, ctx, nd = [1, 1, 4, 2, 6], [5, 3, 9, 0, 2], 3 - 1   # decode rows: the first two
    rows, conv = _setup(lens, ctx, nd)
    groups, state_idx = conv_layout(rows, conv, lens)
    assert len(groups) == 2
    cu = rows.cu.tolist()
    for (r0, r1), (pad_idx, unpad) in zip(((0, nd), (nd, len(lens))), groups):
        lc = max(lens[r0:r1])
        assert pad_idx.shape == (r1 - r0, KM1 + lc)
        for i, b in enumerate(range(r0, r1)):
            want = ([b * KM1 + j for j in range(KM1)]
                    + [conv.token(torch.tensor(cu[b] + j)).item() for j in range(lens[b])]
                    + [conv.zero] * (lc - lens[b]))
            assert pad_idx[i].tolist() == want
        if all(n == lc for n in lens[r0:r1]):
            assert unpad is None
        else:   # packed token t of the run -> its flat row of [b * Lc]
            flat = [(b - r0) * lc + j for b in range(r0, r1) for j in range(lens[b])]
            assert unpad.tolist() == flat
    # the window after the step: the last K-1 inputs of each sequence
    for b in range(len(lens)):
        want = [cu[b] + j + len(lens) * KM1 if j >= 0 else b * KM1 + KM1 + j
                for j in range(lens[b] - KM1, lens[b])]
        assert state_idx[b].tolist() == want


def test_decode_layout_only_for_drafts_and_pads_to_zero_row():
    rows, conv = _setup([1, 1, 5], [4, 6, 0], 2)
    assert decode_layout(rows, conv, [1, 1, 5]) is None      # one token each: no padding
    lens = [3, 1, 2, 4]
    rows, conv = _setup(lens, [4, 6, 2, 0], 3)
    dec = decode_layout(rows, conv, lens)
    td = sum(lens[:3])
    assert dec.pad_src.tolist() == [[0, 1, 2], [3, td, td], [4, 5, td]]
    # unpad is the inverse of pad_src on real tokens
    flat = dec.pad_src.reshape(-1)
    assert flat[dec.unpad_idx].tolist() == list(range(td))
    # after position j of row b: the window ends with token j (past the row: the zero row)
    ld = 3
    for b in range(3):
        for j in range(ld):
            got = dec.window_idx[b * ld + j].tolist()
            want = conv.before(torch.tensor([b]), rows.cu[b:b + 1],
                               torch.tensor([j + 1])).clamp(max=conv.zero)[0].tolist()
            assert got == want
            if j < lens[b]:
                assert got[-1] == conv.token(torch.tensor(int(rows.cu[b]) + j)).item()


def test_prefill_rows_align_chunks_to_absolute_positions():
    lens, ctx = [1, 5, 13, 8], [9, 3, 16, 0]
    rows, conv = _setup(lens, ctx, 1)
    pre, pad_src, unpad, L, is_reshape = prefill_padding(rows, lens, ctx, C)
    assert L % C == 0 and not is_reshape
    td, tp = lens[0], sum(lens[1:])
    for i, b in enumerate(range(1, len(lens))):
        assert int(pre[i]) == ctx[b] % C
        for j in range(lens[b]):
            col = int(pre[i]) + j
            assert col % C == (ctx[b] + j) % C          # chunk boundaries at multiples of C
            assert int(pad_src[i, col]) == int(rows.cu[b]) - td + j
        real = {int(pre[i]) + j for j in range(lens[b])}
        assert all(int(pad_src[i, c]) == tp for c in range(L) if c not in real)
    assert pad_src.reshape(-1)[unpad].tolist() == list(range(tp))


def test_equal_fresh_prefills_are_a_reshape():
    lens = [16, 16]
    rows, conv = _setup(lens, [0, 0], 0)
    kda, dec = kda_layout(rows, conv, lens, [0, 0], C)
    assert kda.pad_is_reshape and dec is None and kda.padded_len == 16
