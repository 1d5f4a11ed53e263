"""The vision demo trainer: a few steps write a servable kimi_k3 checkpoint (vision tower,
projector, tokenizer with Kimi's media tokens, greedy generation config), the loss falls on a
fixed batch, and the trainer's own greedy decode (the one training_summary.json scores) is the
engine's: LLM.chat with the image as a PNG data URL replies with the same tokens."""

from __future__ import annotations

import base64
import io
import json
import random

import numpy as np
import torch

from kdaserve.model.registry import load_config
from kdaserve.engine.llm import LLM
from kdaserve.model.loader import load_model
from kdaserve.request import SamplingParams
from kdaserve.tokenizer import Tokenizer
from kdaserve.train.shapes import HELD_OUT_SEED, draw
from kdaserve.train.vision_demo import Examples, greedy_answer, step_loss, train
from kdaserve.vision_input import VisionInput


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def tok_placeholder(path) -> int:
    return Tokenizer.from_pretrained(path).token_to_id("<|media_pad|>")


def test_trainer_writes_a_model_the_engine_serves_identically(tmp_path):
    torch.set_num_threads(1)
    summary = train(tmp_path, minutes=10, max_steps=12, batch_size=4, log=lambda _: None)
    assert summary["steps"] == 12
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training_summary.json"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "generation_config.json").read_text())["do_sample"] is False
    cfg = load_config(tmp_path)
    assert cfg.vision_config and cfg.media_placeholder_token_id == tok_placeholder(tmp_path)

    tok = Tokenizer.from_pretrained(tmp_path)
    end_id = tok.token_to_id("<|im_end|>")
    ex = Examples(tok, VisionInput.for_model(tmp_path, tok), end_id)
    model = load_model(tmp_path, progress=False).eval()

    llm = LLM(str(tmp_path), max_model_len=1024, num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    for seed in range(HELD_OUT_SEED, HELD_OUT_SEED + 4):
        s = draw(seed)
        mine = greedy_answer(model, ex, s.question, s.image)
        out = llm.chat([{"role": "user", "content": [
            {"type": "text", "text": s.question},
            {"type": "image_url", "image_url": {"url": data_url(s.image)}}]}],
            greedy, use_tqdm=False)[0]
        ids = list(out.outputs[0].token_ids)
        if ids and ids[-1] == end_id:
            ids = ids[:-1]
        assert ids == mine, (seed, ids, mine)
        # the trainer's prompt is the one the engine builds from the same chat
        assert out.prompt_token_ids == ex.prompt(s.question, s.image)[0]


def test_loss_falls_on_a_fixed_batch(tmp_path):
    """Overfitting one batch: the loss, on the answer tokens only, drops by half."""
    from kdaserve.train import vision_demo as vd
    torch.manual_seed(0)
    tok = vd.build_tokenizer(tmp_path)
    end_id = tok.token_to_id("<|im_end|>")
    cfg = vd.model_config(tok.vocab_size, tok.token_to_id("<|media_pad|>"),
                          [tok.token_to_id("<|endoftext|>"), end_id], tok.token_to_id("<|pad|>"))
    from kdaserve.model.loader import save_model
    from kdaserve.model.registry import build_model
    model = build_model(cfg, chunk_size=16)
    save_model(model, tmp_path)
    ex = Examples(tok, VisionInput.for_model(tmp_path, tok), end_id)
    rng = random.Random(1)
    batch = [ex.example(rng.randrange(HELD_OUT_SEED)) for _ in range(4)]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    first = step_loss(model, batch)
    loss = first
    for _ in range(15):
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss = step_loss(model, batch)
    assert loss.item() < first.item() / 2


def test_probe_loss_is_answer_loss_plus_mean_pool_classification(tmp_path):
    """The auxiliary term: cross-entropy of the probe on each image's mean embedding against
    its colour x shape class, added to the answer loss."""
    import torch.nn.functional as F

    from kdaserve.model.loader import save_model
    from kdaserve.model.registry import build_model
    from kdaserve.train import vision_demo as vd
    from kdaserve.train.shapes import COLORS, SHAPES
    torch.manual_seed(0)
    tok = vd.build_tokenizer(tmp_path)
    end_id = tok.token_to_id("<|im_end|>")
    cfg = vd.model_config(tok.vocab_size, tok.token_to_id("<|media_pad|>"),
                          [tok.token_to_id("<|endoftext|>"), end_id], tok.token_to_id("<|pad|>"))
    model = build_model(cfg, chunk_size=16).eval()
    save_model(model, tmp_path)
    ex = Examples(tok, VisionInput.for_model(tmp_path, tok), end_id)
    batch = [ex.example(s) for s in (3, 4, 5)]
    for (_, _, _, label), s in zip(batch, (3, 4, 5)):
        d = draw(s)
        assert label == sorted(COLORS).index(d.color) * len(SHAPES) + SHAPES.index(d.shape)
    probe = torch.nn.Linear(cfg.hidden_size, 12)
    with torch.no_grad():
        feats = model.encode_images(
            torch.from_numpy(np.concatenate([b[2][0].pixels for b in batch])),
            [b[2][0].grid for b in batch])
        want = step_loss(model, batch) + F.cross_entropy(
            probe(torch.stack([f.mean(0) for f in feats])), torch.tensor([b[3] for b in batch]))
        got = step_loss(model, batch, probe)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
