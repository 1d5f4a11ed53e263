"""The vocabulary as llguidance sees it, built from kdaserve's Tokenizer.

HF `tokenizer.json` and tiktoken files are handed to llguidance's own (Rust) loaders, so the
grammar engine tokenizes forced text without calling back into Python. Building it walks the
whole vocabulary (~1.5-2 s at 163,840 tokens): the engine does it once, in the background.
"""

from __future__ import annotations

import copy
from typing import Any

import llguidance as llg

from kdaserve.tokenizer import Tokenizer


def build_lltokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llg.LLTokenizer:
    """`vocab_size`: the model's logits width (may exceed the tokenizer's; the extra ids are
    never allowed)."""
    raw: Any = tokenizer.raw_backend()
    eos = sorted(tokenizer.eos_token_ids) or None
    slices = llg.LLTokenizer.json_slices()   # faster masks inside JSON strings
    n_vocab = max(vocab_size or 0, tokenizer.vocab_size) or None
    if hasattr(raw, "to_str"):               # tokenizers.Tokenizer
        raw = copy.copy(raw)
        raw.no_padding()
        raw.no_truncation()
        return llg.LLTokenizer(raw.to_str(), n_vocab=n_vocab, eos_token=eos, slices=slices)
    if hasattr(raw, "_mergeable_ranks"):     # tiktoken.Encoding
        return llg.LLTokenizer.from_tiktoken(
            encoder=raw._mergeable_ranks, special_tokens=raw._special_tokens,
            pattern=raw._pat_str, eos_token=eos if eos else raw.eot_token, n_vocab=n_vocab,
            slices=slices)
    raise TypeError("structured outputs need an HF tokenizer.json or a tiktoken vocabulary")
