"""The packed rows every layout builder shares (kdaserve/model/layout/rows.py), against
plain Python loops over the same sequences."""

from __future__ import annotations

import torch

from kdaserve.model.layout.rows import ConvRows, PackedRows

CPU = torch.device("cpu")
LENS, CTX = [1, 3, 5, 2], [7, 4, 0, 9]          # two decode rows, then two prefill rows


def test_packed_rows_place_every_token():
    rows = PackedRows.build(LENS, CTX, 2, CPU)
    seq_of, local, pos = [], [], []
    for b, (n, c) in enumerate(zip(LENS, CTX)):
        seq_of += [b] * n
        local += list(range(n))
        pos += [c + j for j in range(n)]
    assert rows.seq_of.tolist() == seq_of
    assert rows.local.tolist() == local
    assert rows.positions.tolist() == pos
    assert rows.cu.tolist() == [0, 1, 4, 9, 11]
    assert (rows.num_tokens, rows.num_decode_tokens, rows.num_seqs) == (11, 4, 4)


def _before(b: int, upto: int, km1: int, conv: ConvRows, start: int) -> list[int]:
    """The K-1 conv inputs before local position `upto` of sequence b, one at a time."""
    out = []
    for j in range(upto - km1, upto):
        out.append(conv.num_seqs * km1 + start + j if j >= 0 else b * km1 + km1 + j)
    return out


def test_conv_rows_before_reaches_back_into_the_window():
    rows = PackedRows.build(LENS, CTX, 2, CPU)
    km1 = 3
    conv = ConvRows(len(LENS), km1, rows.num_tokens)
    assert conv.zero == len(LENS) * km1 + rows.num_tokens
    for b in range(len(LENS)):
        for upto in range(LENS[b] + 1):
            got = conv.before(torch.tensor([b]), rows.cu[b:b + 1], torch.tensor([upto]))
            assert got[0].tolist() == _before(b, upto, km1, conv, int(rows.cu[b])), (b, upto)
    # the rows name what they say: window entries first, then tokens, then the zero row
    ext = torch.arange(conv.zero + 1)
    assert int(ext[conv.window(torch.tensor(1), torch.tensor(2))]) == 1 * km1 + 2
    assert int(ext[conv.token(torch.tensor(0))]) == len(LENS) * km1
