"""A temperature-conditioned DSpark draft: each row's block reads its own request's temperature
(and nothing of its batch mates'), greedy is temperature 0, the flag and the embedding survive
a save and a load, and an unconditioned draft ignores temperatures."""

from __future__ import annotations

import json

import torch

from kdaserve.model.dspark import DraftConfig, DSparkDraft, training_mask


def _draft(conditioned: bool, seed: int = 0) -> DSparkDraft:
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=16, vocab_size=32, target_layer_ids=(0,), block_size=4,
                      num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                      qk_rope_head_dim=4, v_head_dim=4, intermediate_size=24, markov_rank=4,
                      temperature_conditioning=conditioned)
    d = DSparkDraft(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d.eval()


def _block(d: DSparkDraft, temps, b: int = 3, ctx_len: int = 6):
    g = torch.Generator().manual_seed(1)
    hid = d.config.hidden_size
    hidden = torch.randn(b * ctx_len, hid, generator=g)
    pos = torch.arange(ctx_len).repeat(b)
    ctx = [x.view(b, ctx_len, -1) for x in d.context_latents(hidden, pos)]
    anchors = torch.full((b, 1), ctx_len - 2)
    first = torch.randn(b, 1, hid, generator=g)
    q_pos = anchors + torch.arange(4)
    with torch.no_grad():
        return d.block_hidden(first, q_pos, ctx, training_mask(ctx_len, anchors, 4), 4, temps)


def test_each_row_reads_its_own_temperature():
    d = _draft(True)
    base = _block(d, torch.tensor([0.0, 0.8, 1.0]))
    other = _block(d, torch.tensor([0.0, 0.3, 1.0]))
    assert torch.equal(base[0], other[0]) and torch.equal(base[2], other[2])
    assert not torch.allclose(base[1], other[1])
    # greedy is temperature 0, whether said or not
    assert torch.equal(_block(d, None)[0], _block(d, torch.zeros(3))[0])


def test_hotter_requests_read_the_hottest_trained_temperature():
    d = _draft(True)
    assert d.config.max_conditioning_temperature == 1.0
    assert torch.equal(_block(d, torch.tensor([0.0, 1.0, 1.0])),
                       _block(d, torch.tensor([0.0, 1.0, 1.7])))


def test_an_unconditioned_draft_ignores_temperatures():
    d = _draft(False)
    assert not hasattr(d, "temperature_embedding")
    assert torch.equal(_block(d, None), _block(d, torch.tensor([0.0, 0.8, 1.0])))


def test_the_conditioning_survives_save_and_load(tmp_path):
    d = _draft(True, seed=2)
    d.save_pretrained(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())[
        "temperature_conditioning"] is True
    back = DSparkDraft.from_pretrained(tmp_path / "d")
    assert back.config.temperature_conditioning
    assert torch.equal(back.temperature_embedding, d.temperature_embedding)
    t = torch.tensor([0.0, 0.7, 1.2])
    assert torch.equal(_block(back, t), _block(d, t))


def test_the_released_layout_has_no_conditioning():
    cfg = DraftConfig(hidden_size=16, vocab_size=32, target_layer_ids=(0,), mask_token_id=5,
                      layout="k3_dspark", temperature_conditioning=False)
    assert "temperature_conditioning" not in cfg.to_dict()
