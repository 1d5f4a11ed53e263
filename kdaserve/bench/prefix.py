"""`kdaserve bench prefix`: time to first token with a shared prefix, prefix caching off vs on,
in one run; plus a multi-turn chat workload and the prefill tokens it saves."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kdaserve.assets import default_model_path
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams


def _ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - start


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def shared_prefix(llm_on: LLM, llm_off: LLM, prefix_len: int, num_suffixes: int,
                  suffix_len: int, vocab: int, seed: int, check_tokens: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab, (prefix_len,), generator=g).tolist()
    prompts = [prefix + torch.randint(4, vocab, (suffix_len,), generator=g).tolist()
               for _ in range(num_suffixes)]
    _ttft(llm_off, prompts[0][:64])                               # warm-up both engines
    _ttft(llm_on, [1, 2, 3])
    cold = [_ttft(llm_off, p) for p in prompts]
    _ttft(llm_on, prefix + [5])                                   # the first user warms it
    st = llm_on.engine.cache.stats
    q0, h0 = st.query_tokens, st.hit_tokens
    warm = [_ttft(llm_on, p) for p in prompts]
    hit_rate = (st.hit_tokens - h0) / max(1, st.query_tokens - q0)
    identical = _greedy(llm_on, prompts, check_tokens) == _greedy(llm_off, prompts, check_tokens)
    cold_s, warm_s = statistics.mean(cold), statistics.mean(warm)
    return {"prefix_len": prefix_len, "num_suffixes": num_suffixes, "suffix_len": suffix_len,
            "ttft_cold_s": round(cold_s, 4), "ttft_warm_s": round(warm_s, 4),
            "speedup": round(cold_s / warm_s, 2), "hit_rate": round(hit_rate, 4),
            "snapshot_bytes": llm_on.engine.cache.snapshots.bytes_held,
            "num_snapshots": llm_on.engine.cache.snapshots.num_used, "identical": identical}


def multi_turn(llm_on: LLM, llm_off: LLM, turns: int, turn_len: int, answer_len: int,
               vocab: int, seed: int) -> dict:
    """A chat where every turn resends the whole history plus a new user message."""
    g = torch.Generator().manual_seed(seed + 1)
    sp = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    history: list[int] = []
    computed_on = computed_off = prompt_total = 0
    identical = True
    for _ in range(turns):
        history = history + torch.randint(4, vocab, (turn_len,), generator=g).tolist()
        prompt_total += len(history)
        outs = []
        for llm in (llm_on, llm_off):
            before = llm.engine.runner.num_forward_tokens
            outs.append(llm.generate([{"prompt_token_ids": history}], sp,
                                     use_tqdm=False)[0].outputs[0].token_ids)
            done = llm.engine.runner.num_forward_tokens - before - (answer_len - 1)
            if llm is llm_on:
                computed_on += done
            else:
                computed_off += done
        identical &= outs[0] == outs[1]
        history = history + outs[0]
    return {"turns": turns, "prompt_tokens": prompt_total,
            "prefill_tokens_computed_off": computed_off, "prefill_tokens_computed_on": computed_on,
            "prefill_tokens_saved": computed_off - computed_on,
            "saved_fraction": round(1 - computed_on / max(1, computed_off), 4),
            "identical": identical}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: bundled demo)")
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--num-suffixes", type=int, default=32)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-len", type=int, default=96)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--check-tokens", type=int, default=16,
                   help="greedy tokens compared between caching on and off")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-memory", type=int, default=512 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    model = str(args.model or default_model_path())
    max_len = args.prefix_len + args.suffix_len + 64
    max_len = max(max_len, args.turns * (args.turn_len + args.answer_len) + 64)
    common = dict(block_size=args.block_size, cache_memory=args.cache_memory,
                  max_model_len=max_len, max_num_batched_tokens=2048)
    llm_off = LLM(model, enable_prefix_caching=False, **common)
    llm_on = LLM(model, enable_prefix_caching=True, **common)
    vocab = llm_on.engine.model.config.vocab_size
    result = shared_prefix(llm_on, llm_off, args.prefix_len, args.num_suffixes, args.suffix_len,
                           vocab, args.seed, args.check_tokens)
    result["multi_turn"] = multi_turn(llm_on, llm_off, args.turns, args.turn_len,
                                      args.answer_len, vocab, args.seed)
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
