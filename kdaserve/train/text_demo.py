"""The Kimi Linear text demo: build it from the Shakespeare corpus, end to end (`kdaserve train
--arch kimi_linear`; the K3 demo, k3_demo.py, trains on the same text data).

Data: the plays as plain text, documents separated by <|endoftext|>, plus chat transcripts made
from consecutive speeches (user = one speech, assistant = the reply) in the tokenizer's ChatML
template, so /v1/chat/completions answers in kind and stops at <|im_end|>.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from kdaserve.model.registry import hf_config, load_config
from kdaserve.train.bpe import DEFAULT_SPECIALS, save_tokenizer, train_bpe_tokenizer
from kdaserve.train.corpus import Document, fetch_shakespeare, load_corpus, split_documents
from kdaserve.train.trainer import TrainConfig, demo_model_config, train

GENERATION_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1}


def speeches(doc: Document) -> list[str]:
    """Blocks that start with an upper-case speaker label ("ROMEO:")."""
    blocks = [b.strip() for b in re.split(r"\n\s*\n", doc.text)]
    return [b for b in blocks if re.match(r"^[A-Z][A-Z .'-]*:", b)]


def chat_transcripts(docs: list[Document], share: float, seed: int) -> list[str]:
    """Two-turn chats from consecutive speeches of the same play (deterministic)."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        sp = speeches(doc)
        for a, b in zip(sp, sp[1:]):
            if rng.random() < share:
                user = a.split(":", 1)[1].strip()
                out.append(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{b}"
                           "<|im_end|>\n")
    return out


@dataclass
class TextData:
    """The demo's tokenizer and its training and held-out token streams."""
    tok: HFTokenizer
    train_docs: list[Document]
    eval_docs: list[Document]
    train_ids: torch.Tensor
    eval_ids: torch.Tensor
    chat_transcripts: int


def text_data(*, vocab_size: int, seed: int, chat_share: float, resume: Path | None = None,
              specials: tuple[str, ...] = DEFAULT_SPECIALS,
              extra_tokenizer_texts: list[str] | None = None) -> TextData:
    """Corpus -> tokenizer -> ids. With `resume`, that checkpoint's tokenizer is reused, so the
    token ids stay the same."""
    docs = load_corpus(fetch_shakespeare())
    train_docs, eval_docs = split_documents(docs, eval_fraction=0.05, seed=seed)
    if resume is not None:
        tok = HFTokenizer.from_file(str(resume / "tokenizer.json"))
    else:
        texts = [d.text for d in train_docs] + list(extra_tokenizer_texts or [])
        tok = train_bpe_tokenizer(texts, vocab_size=vocab_size, special_tokens=specials)
    eos = tok.token_to_id("<|endoftext|>")

    def encode(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for t in texts:
            ids.extend(tok.encode(t).ids)
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)

    train_texts = [d.text for d in train_docs] + chat_transcripts(train_docs, chat_share, seed)
    random.Random(seed).shuffle(train_texts)
    return TextData(tok, train_docs, eval_docs, encode(train_texts),
                    encode([d.text for d in eval_docs]), len(train_texts) - len(train_docs))


def write_generation_config(out: Path, tok: HFTokenizer) -> None:
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    gen = {"do_sample": True, **GENERATION_DEFAULTS, "eos_token_id": [eos, im_end],
           "pad_token_id": tok.token_to_id("<|pad|>")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def write_summary(out: Path, result: dict, data: TextData) -> dict:
    summary = {k: v for k, v in result.items() if k != "model"}
    summary["data"] = {"train_documents": [d.name for d in data.train_docs],
                       "eval_documents": [d.name for d in data.eval_docs],
                       "train_tokens": len(data.train_ids), "eval_tokens": len(data.eval_ids),
                       "chat_transcripts": data.chat_transcripts}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def build(out: Path, *, vocab_size: int, minutes: float, seed: int, chat_share: float,
          train_cfg: TrainConfig, resume: Path | None = None) -> dict:
    """Corpus -> tokenizer -> model. With `resume`, training continues from that checkpoint
    (its tokenizer is reused, so the token ids stay the same)."""
    data = text_data(vocab_size=vocab_size, seed=seed, chat_share=chat_share, resume=resume)
    tok = data.tok
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out)
    eos, im_end, pad = (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|pad|>"))
    model_cfg = demo_model_config(tok.get_vocab_size(), eos, pad)
    model_cfg = load_config({**hf_config(model_cfg), "eos_token_id": [eos, im_end]})
    cfg = TrainConfig(**{**train_cfg.__dict__, "time_budget_s": minutes * 60, "seed": seed})
    result = train(model_cfg, data.train_ids, data.eval_ids, cfg, out_dir=out, init_from=resume)
    write_generation_config(out, tok)
    return write_summary(out, result, data)
