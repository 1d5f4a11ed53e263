"""The KDA ops against fla-core's naive reference (written by others)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kdaserve.ops.kda import kda_chunk, kda_recurrent, kda_step


def _fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)  # by path: fla/__init__ imports triton
    return mod


def _inputs(b, t, h, k, v, seed=0, strong_decay=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, k, generator=g), dim=-1) * k ** -0.5
    kk = F.normalize(torch.randn(b, t, h, k, generator=g), dim=-1)
    vv = torch.randn(b, t, h, v, generator=g)
    scale = 30.0 if strong_decay else 2.0
    gg = -torch.rand(b, t, h, k, generator=g) * scale
    beta = torch.rand(b, t, h, generator=g)
    s0 = torch.randn(b, h, k, v, generator=g)
    return q, kk, vv, gg, beta, s0


@pytest.mark.parametrize("t,chunk", [(64, 16), (37, 8), (5, 16), (130, 64)])
def test_chunk_matches_fla_recurrent(t, chunk):
    fla = _fla_naive()
    q, k, v, g, beta, s0 = _inputs(2, t, 3, 16, 8)
    ref_o, ref_s = fla.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=s0,
                                           output_final_state=True)
    pad = (-t) % chunk
    padded = [F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g)]
    bpad = F.pad(beta, (0, 0, 0, pad))
    o, s, _ = kda_chunk(*padded, bpad, s0, chunk)
    assert (o[:, :t] - ref_o).abs().max() < 2e-5
    assert (s - ref_s).abs().max() < 2e-5


def test_chunk_matches_fla_chunk_and_strong_decay_is_finite():
    fla = _fla_naive()
    q, k, v, g, beta, s0 = _inputs(1, 64, 2, 32, 32, seed=1, strong_decay=True)
    ref_o, ref_s = fla.naive_chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=s0,
                                       output_final_state=True, chunk_size=16)
    rec_o, rec_s = fla.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=s0,
                                           output_final_state=True)
    o, s, _ = kda_chunk(q, k, v, g, beta, s0, 16)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert (o - rec_o).abs().max() < 2e-5 and (s - rec_s).abs().max() < 2e-5
    if torch.isfinite(ref_o).all():  # fla's chunk form may overflow with strong decay
        assert (o - ref_o).abs().max() < 1e-3


def test_recurrent_and_step_match_fla():
    fla = _fla_naive()
    q, k, v, g, beta, s0 = _inputs(3, 9, 2, 8, 8, seed=2)
    ref_o, ref_s = fla.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=s0,
                                           output_final_state=True)
    o, s, kept = kda_recurrent(q, k, v, g, beta, s0, keep_states=True)
    assert (o - ref_o).abs().max() < 1e-5 and (s - ref_s).abs().max() < 1e-5
    assert torch.equal(kept[:, -1], s)
    o1, s1 = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    assert (o1 - ref_o[:, 0]).abs().max() < 1e-5


def test_chunk_states_at_chunk_ends_match_recurrence():
    q, k, v, g, beta, s0 = _inputs(2, 32, 2, 8, 8, seed=3)
    _, _, kept_rec = kda_recurrent(q, k, v, g, beta, s0, keep_states=True)
    _, _, kept = kda_chunk(q, k, v, g, beta, s0, 8, keep_chunk_states=True)
    for n in range(4):
        assert (kept[:, n] - kept_rec[:, 8 * n + 7]).abs().max() < 1e-5


def test_zero_padding_rows_are_identity():
    q, k, v, g, beta, s0 = _inputs(1, 8, 2, 8, 8, seed=4)
    z = [torch.zeros_like(x[:, :3]) for x in (q, k, v, g)]
    padded = [torch.cat([zz, x], 1) for zz, x in zip(z, (q, k, v, g))]
    pb = torch.cat([torch.zeros_like(beta[:, :3]), beta], 1)
    pb = F.pad(pb, (0, 0, 0, 5))
    padded = [F.pad(x, (0, 0, 0, 0, 0, 5)) for x in padded]
    o, s, _ = kda_chunk(*padded, pb, s0, 16)
    o_ref, s_ref, _ = kda_chunk(*[F.pad(x, (0, 0, 0, 0, 0, 8)) for x in (q, k, v, g)],
                                F.pad(beta, (0, 0, 0, 8)), s0, 16)
    assert (o[:, 3:11] - o_ref[:, :8]).abs().max() < 1e-5
    assert (s - s_ref).abs().max() < 1e-5


@pytest.mark.parametrize("chunk,sub", [(16, 1), (16, 2), (16, 16), (64, 8), (32, 4)])
def test_sub_chunk_factorisation_is_exact(chunk, sub):
    fla = _fla_naive()
    q, k, v, g, beta, s0 = _inputs(1, 64, 2, 8, 8, seed=5, strong_decay=True)
    ref_o, ref_s = fla.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=s0,
                                           output_final_state=True)
    o, s, _ = kda_chunk(q, k, v, g, beta, s0, chunk, sub_chunk=sub)
    assert (o - ref_o).abs().max() < 2e-5 and (s - ref_s).abs().max() < 2e-5
