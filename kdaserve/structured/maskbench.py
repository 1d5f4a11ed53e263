"""Measure llguidance's per-token mask cost at Kimi's vocabulary size (163,840).

`python -m kdaserve.structured.maskbench` builds the synthetic vocabulary (synthetic.py), the
grammar of a nested JSON schema, and times the masks along one valid document: one request at
a time, and 32 requests in one batched call. docs/structured-outputs.md has the figures.
"""

from __future__ import annotations

import json
import time

import llguidance as llg
import llguidance.torch as llt
import numpy as np
import torch

from kdaserve.structured.compiler import _COMPACT
from kdaserve.structured.synthetic import KIMI_VOCAB, GreedyEncoder, synthetic_vocab

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False}
DOC = {"name": "Juliet Capulet of Verona", "age": 13, "role": "guest",
       "tags": ["balcony", "romance", "tragedy"], "address": {"city": "Verona", "zip": "37121"},
       "score": 0.875}


def main(batch: int = 32, threads: int = 1) -> dict[str, float]:
    vocab = synthetic_vocab()
    ranks = {t: i for i, t in enumerate(vocab) if i}
    start = time.perf_counter()
    tok = llg.LLTokenizer.from_tiktoken(
        encoder=ranks, special_tokens={"<|eos|>": 0}, eos_token=0, n_vocab=KIMI_VOCAB,
        pattern=r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+",
        slices=llg.LLTokenizer.json_slices())
    setup = time.perf_counter() - start
    ids = GreedyEncoder(vocab)(json.dumps(DOC)) + [0]
    start = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=_COMPACT)
    llg.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - start
    words = (KIMI_VOCAB + 31) // 32
    single = []
    for _ in range(3):
        m, mask = llg.LLMatcher(tok, grammar), torch.zeros(1, words, dtype=torch.int32)
        for t in ids:
            a = time.perf_counter()
            llt.fill_next_token_bitmask(m, mask, 0)
            single.append(time.perf_counter() - a)
            assert m.consume_token(t), m.get_error()
    ex = llg.LLExecutor(num_threads=threads)
    ms = [llg.LLMatcher(tok, grammar) for _ in range(batch)]
    mask = torch.zeros(batch, words, dtype=torch.int32)
    batched = []
    for t in ids:
        a = time.perf_counter()
        llt.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], mask)
        batched.append(time.perf_counter() - a)
        for m in ms:
            m.consume_token(t)
    ms_ = 1e3
    return {"vocab": KIMI_VOCAB, "tokens": len(ids), "tokenizer_setup_s": setup,
            "compile_ms": compile_s * ms_, "single_mean_ms": float(np.mean(single)) * ms_,
            "single_median_ms": float(np.median(single)) * ms_,
            "single_p99_ms": float(np.percentile(single, 99)) * ms_,
            f"batch{batch}_mean_ms": float(np.mean(batched)) * ms_,
            f"batch{batch}_median_ms": float(np.median(batched)) * ms_}


if __name__ == "__main__":
    for key, value in main().items():
        print(f"{key:<22} {value:.3f}" if isinstance(value, float) else f"{key:<22} {value}")
