"""Training a temperature-conditioned draft: each sequence is distilled at the temperature
extract-hidden wrote it at, and the per-row loss is the shared-temperature loss when the rows
agree."""

from __future__ import annotations

import json

import pytest
import torch

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.model.dspark import DSparkDraft
from kdaserve.train.draft import (BlockLogits, _generation_temperatures, conditioned_loss,
                                  distill_loss)


def test_sequences_take_the_round_robin_temperatures():
    meta = {"generated": 16, "temperatures": [0.0, 0.6, 0.8, 1.0]}
    t = _generation_temperatures(meta, 6)
    assert t.tolist() == pytest.approx([0.0, 0.6, 0.8, 1.0, 0.0, 0.6])
    with pytest.raises(ValueError, match="known temperatures"):
        _generation_temperatures({"generated": 0, "temperatures": []}, 6)


def test_the_per_row_loss_is_the_shared_loss_when_rows_agree():
    g = torch.Generator().manual_seed(0)
    z = BlockLogits(torch.randn(3, 8, 11, generator=g), torch.randn(3, 8, 11, generator=g), 4)
    for t in (0.3, 0.8):
        assert torch.allclose(conditioned_loss(z, torch.full((3,), t)), distill_loss(z, (t,)))
    # rows at their own temperatures: the mean of each row's loss alone
    mixed = conditioned_loss(z, torch.tensor([0.3, 0.8, 1.0]))
    alone = [distill_loss(BlockLogits(z.draft[i:i + 1], z.target[i:i + 1], 4), (t,))
             for i, t in enumerate((0.3, 0.8, 1.0))]
    assert torch.allclose(mixed, torch.stack(alone).mean())


def test_a_conditioned_draft_trains_and_loads(tmp_path):
    from kdaserve.train.draft import train_draft
    from kdaserve.train.draft_data import extract_hidden

    text = tmp_path / "corpus.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 20)
    extract_hidden(str(kimi_linear_demo_path()), str(text), str(tmp_path / "hid"),
                   prompt_len=8, generate=16, max_seqs=8, batch=4)
    # the link the training relies on: sequence i was written at temperature i mod 4, so
    # sequence 4 (T 0) is the target's greedy continuation of its prompt
    from kdaserve import LLM, SamplingParams
    from kdaserve.train.draft import _load_shards

    data, meta = _load_shards(tmp_path / "hid")
    assert _generation_temperatures(meta, 8)[4] == 0.0
    ids = data["input_ids"][4].tolist()
    greedy = LLM(str(kimi_linear_demo_path())).generate(
        [{"prompt_token_ids": ids[:8]}],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == ids[8:]
    report = train_draft(str(kimi_linear_demo_path()), str(tmp_path / "hid"),
                         str(tmp_path / "d"), steps=3, batch=2, anchors=2, block=4,
                         condition_temperature=True)
    assert report["temperature_conditioning"] is True
    assert json.loads((tmp_path / "d" / "config.json").read_text())["temperature_conditioning"]
    d = DSparkDraft.from_pretrained(tmp_path / "d")
    assert d.temperature_embedding.abs().sum() > 0      # trained, not left at zero
