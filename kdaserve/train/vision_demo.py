"""Train the small vision demo model on the synthetic shapes task (kdaserve/train/shapes.py).

A Kimi K3-layout checkpoint (text under `language_model.`, MoonViT `vision_tower` +
`mm_projector`) with a tiny KDA + MLA text model and a BPE tokenizer that has Kimi's media
tokens. Each example is the chat the server renders for one user turn (question + image) and
the assistant's answer; the loss is on the answer and its end-of-turn token only. The model,
the engine and the server are the same code that serves it.

    python -m kdaserve.train.vision_demo --out DIR [--minutes 10] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kdaserve.model.batch import build_forward_batch
from kdaserve.model.loader import save_model
from kdaserve.model.registry import build_model, load_config
from kdaserve.model_config import ModelConfig
from kdaserve.tokenizer import Tokenizer
from kdaserve.train.bpe import DEFAULT_SPECIALS, save_tokenizer, train_bpe_tokenizer
from kdaserve.train.shapes import COLORS, HELD_OUT_SEED, QUESTIONS, SHAPES, draw, parse_answer
from kdaserve.vision_input import VisionInput, split_chat_images

MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


def model_config(vocab: int, placeholder: int, eos: list[int], pad: int) -> ModelConfig:
    text = {
        "vocab_size": vocab, "hidden_size": 96, "intermediate_size": 192,
        "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                               "head_dim": 32, "short_conv_kernel_size": 4},
        "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "mla_use_nope": True, "first_k_dense_replace": 2,
        "num_experts": 0, "num_experts_per_token": 0, "moe_intermediate_size": 0,
        "eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None,
    }
    vision = {"vt_hidden_size": 64, "vt_intermediate_size": 128, "vt_num_hidden_layers": 2,
              "vt_num_attention_heads": 4, "patch_size": 14, "init_pos_emb_height": 20,
              "init_pos_emb_width": 20, "merge_kernel_size": [2, 2], "mm_hidden_size": 64,
              "text_hidden_size": 96, "mm_projector_type": "patchmerger",
              "projector_ln_eps": 1e-5}
    return load_config({"model_type": "kimi_k3", "text_config": text,
                                  "vision_config": vision,
                                  "media_placeholder_token_id": placeholder})


def build_tokenizer(out: Path) -> Tokenizer:
    texts = [q for q in QUESTIONS for _ in range(20)]
    texts += [f"a {c} {s}" for c in COLORS for s in SHAPES for _ in range(20)]
    texts += ["user assistant system"] * 20
    tok = train_bpe_tokenizer(texts, vocab_size=400, special_tokens=DEFAULT_SPECIALS + MEDIA_TOKENS)
    save_tokenizer(tok, out, model_max_length=4096)
    return Tokenizer.from_pretrained(out)


def write_generation_config(out: Path, tok: Tokenizer) -> None:
    """Greedy by default: the task has one right answer, and a client that sends no temperature
    should get it; the answer ends at <|im_end|>."""
    gen = {"do_sample": False, "max_new_tokens": 16,
           "eos_token_id": [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")],
           "pad_token_id": tok.token_to_id("<|pad|>")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


class Examples:
    """Chat-rendered (question, image) prompts + answers as ids, with their images' media."""

    def __init__(self, tok: Tokenizer, vision: VisionInput, end_id: int) -> None:
        self.tok, self.vision, self.end_id = tok, vision, end_id

    def prompt(self, question: str, image) -> tuple[list[int], list]:
        msgs, _ = split_chat_images([{"role": "user", "content": [
            {"type": "text", "text": question}, {"type": "image_url", "image_url": None}]}],
            self.vision.marker)
        text = self.tok.apply_chat_template(msgs, add_generation_prompt=True)
        return self.vision.expand(self.tok.encode(text), [image])

    def example(self, seed: int) -> tuple[list[int], int, list, int]:
        """(prompt + answer + <|im_end|>, prompt length, media, class of colour x shape)."""
        s = draw(seed)
        ids, media = self.prompt(s.question, s.image)
        answer = self.tok.encode(s.answer)
        return ids + answer + [self.end_id], len(ids), media, label_of(s.color, s.shape)


def label_of(color: str, shape: str) -> int:
    return sorted(COLORS).index(color) * len(SHAPES) + SHAPES.index(shape)


def step_loss(model, batch: list[tuple[list[int], int, list, int]],
              probe: torch.nn.Linear | None = None) -> torch.Tensor:
    """Cross-entropy on the answers; with `probe`, plus an auxiliary loss: the probe classifies
    colour x shape from each image's mean embedding. Why: on the answer loss alone the tower
    learns colour at once but shape not in 1100 steps (the gradient reaching the tower through
    the text model's attention is too weak); the same tower with a mean-pool probe learns shape
    in ~500. Mean pooling is what near-uniform attention over an image reads, so features the
    probe separates are features the text model can read. The probe is not part of the model."""
    ids = torch.tensor([t for seq, *_ in batch for t in seq])
    media = [m for _, _, ms, _ in batch for m in ms]
    feats = model.encode_images(torch.from_numpy(np.concatenate([m.pixels for m in media])),
                                [m.grid for m in media])
    x = model.model.embed_tokens(ids)
    rows, at = [], 0
    targets = torch.full_like(ids, -100)
    for (seq, n_prompt, ms, _), f in zip(batch, feats):
        m = ms[0]
        rows.append((at + m.offset, f))
        targets[at + n_prompt - 1: at + len(seq) - 1] = ids[at + n_prompt: at + len(seq)]
        at += len(seq)
    x = x.clone()
    for start, f in rows:
        x[start:start + f.shape[0]] = f
    fb = build_forward_batch([len(s) for s, *_ in batch],
                             conv_kernel=model.config.conv_kernel_size,
                             chunk_size=model.chunk_size)
    logits, _ = model(ids, fb, inputs_embeds=x)
    loss = F.cross_entropy(logits, targets, ignore_index=-100)
    if probe is not None:
        pooled = torch.stack([f.mean(0) for f in feats])
        labels = torch.tensor([label for *_, label in batch])
        loss = loss + F.cross_entropy(probe(pooled), labels)
    return loss


@torch.no_grad()
def greedy_answer(model, ex: Examples, question: str, image, max_tokens: int = 6) -> list[int]:
    """The greedy reply's ids (full recompute each step, no cache; stops at <|im_end|>)."""
    ids, media = ex.prompt(question, image)
    feat = model.encode_images(torch.from_numpy(media[0].pixels), [media[0].grid])[0]
    out: list[int] = []
    for _ in range(max_tokens):
        t = torch.tensor(ids + out)
        x = model.model.embed_tokens(t).clone()
        x[media[0].offset:media[0].end] = feat
        fb = build_forward_batch([len(t)], conv_kernel=model.config.conv_kernel_size,
                                 chunk_size=model.chunk_size)
        nxt = int(model(t, fb, inputs_embeds=x)[0][-1].argmax())
        if nxt == ex.end_id:
            break
        out.append(nxt)
    return out


def accuracy(model, ex: Examples, seeds: range) -> float:
    """Greedy answers on held-out samples: colour and shape both right."""
    model.eval()
    right = 0
    for seed in seeds:
        s = draw(seed)
        reply = ex.tok.decode(greedy_answer(model, ex, s.question, s.image))
        right += parse_answer(reply) == (s.color, s.shape)
    model.train()
    return right / len(seeds)


def train(out: Path, minutes: float, max_steps: int, batch_size: int = 16, lr: float = 2e-3,
          seed: int = 0, log=print) -> dict:
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    end_id = tok.token_to_id("<|im_end|>")
    cfg = model_config(tok.vocab_size, tok.token_to_id("<|media_pad|>"),
                       [tok.token_to_id("<|endoftext|>"), end_id], tok.token_to_id("<|pad|>"))
    model = build_model(cfg, chunk_size=16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.normal_(0, 0.5, generator=g)
            elif p.dim() >= 2:
                # the tower: 1/sqrt(fan-in) over all input dims (the patch embedding's fan-in
                # is 3*14*14, not 14: with 14 its outputs swamp the position table and the
                # residual stream, and the blocks barely change it: colour is learned, shape
                # never); the position table so comes out at ~0.03, as ViT's 0.02
                std = 1 / math.sqrt(p[0].numel()) if "vision" in name else 0.02
                p.normal_(0, std, generator=g)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    save_model(model, out)          # config.json first: VisionInput reads it
    vision = VisionInput.for_model(out, tok)
    ex = Examples(tok, vision, end_id)
    probe = torch.nn.Linear(cfg.hidden_size, len(COLORS) * len(SHAPES))
    opt = torch.optim.AdamW([*model.parameters(), *probe.parameters()], lr=lr,
                            weight_decay=0.01)
    rng = random.Random(seed)
    t0, step, history = time.monotonic(), 0, []
    model.train()
    while step < max_steps and time.monotonic() - t0 < minutes * 60:
        frac = min(1.0, (time.monotonic() - t0) / (minutes * 60))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * (1 + math.cos(
                math.pi * frac)) / 2)
        batch = [ex.example(rng.randrange(HELD_OUT_SEED)) for _ in range(batch_size)]
        loss = step_loss(model, batch, probe)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            acc = accuracy(model, ex, range(HELD_OUT_SEED, HELD_OUT_SEED + 24))
            history.append({"step": step, "loss": round(loss.item(), 4), "held_out_acc": acc,
                            "minutes": round((time.monotonic() - t0) / 60, 2)})
            log(json.dumps(history[-1]))
    model.eval()
    save_model(model, out)
    write_generation_config(out, tok)
    summary = {"steps": step, "minutes": round((time.monotonic() - t0) / 60, 2),
               "batch_size": batch_size,
               "held_out_accuracy_200": accuracy(model, ex, range(HELD_OUT_SEED,
                                                                  HELD_OUT_SEED + 200)),
               "history": history}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    s = train(args.out, args.minutes, args.steps, args.batch_size, args.lr, args.seed)
    print(json.dumps({k: v for k, v in s.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
