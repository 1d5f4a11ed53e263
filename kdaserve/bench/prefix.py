"""`kdaserve bench prefix`: time to first token with a shared prefix, prefix caching off vs on,
in one run; plus a multi-turn chat workload and the prefill tokens it saves.

With `--offload host|disk|host,disk` it also times hits served from an offload tier: before
each such request the device copies of the cache are handed to the tier and forgotten, so the
prefix comes back through load operations (`ttft_tier_s`, `tier_speedup` = cold / tier, cold
timed in the same pairs). For the disk tier alone, `ttft_tier_uncached_s` also drops the
entries from the OS page cache first (fsync + posix_fadvise DONTNEED on each file), i.e. reads
that really reach the disk."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

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
    expected = _greedy(llm_off, prompts, check_tokens)
    identical = _greedy(llm_on, prompts, check_tokens) == expected
    cold_s, warm_s = statistics.mean(cold), statistics.mean(warm)
    out = {"prefix_len": prefix_len, "num_suffixes": num_suffixes, "suffix_len": suffix_len,
           "ttft_cold_s": round(cold_s, 4), "ttft_warm_s": round(warm_s, 4),
           "speedup": round(cold_s / warm_s, 2), "hit_rate": round(hit_rate, 4),
           "snapshot_bytes": llm_on.engine.cache.snapshots.bytes_held,
           "num_snapshots": llm_on.engine.cache.snapshots.num_used, "identical": identical}
    if llm_on.engine.cache.offload is not None:
        # fresh suffixes, so a tier hit covers the prefix only, like a warm hit
        fresh = [prefix + torch.randint(4, vocab, (suffix_len,), generator=g).tolist()
                 for _ in range(2 * min(8, num_suffixes))]
        out.update(_tier(llm_on, llm_off, fresh, prompts, expected, check_tokens))
        out["identical"] = identical and out["identical_tier"]
    return out


def _tier(llm: LLM, llm_off: LLM, fresh: list[list[int]], prompts: list[list[int]],
          expected: list[list[int]], check_tokens: int) -> dict:
    """Hits served from the offload tier, timed in pairs with their baselines: for each pair of
    fresh suffixes, cold (caching off) on the first, then the first again with the device
    copies dropped (a tier hit), then the second (a device hit on what the tier brought back).
    Back to back, so a change in the machine's load between phases does not skew the ratios.
    Then the greedy outputs of `prompts` served from the tier against caching off."""
    eng = llm.engine
    moved = eng.runner.cache_ops.stats
    before = {t: (s.loaded_bytes, s.loaded_entries, s.load_seconds) for t, s in moved.items()}
    st = eng.cache.stats
    disk = eng.runner.cache_ops.stores.get("disk")
    # disk alone: every other tier hit also reads past the OS page cache (host,disk reads host)
    uncached = len(eng.runner.cache_ops.stores) == 1 and disk is not None \
        and hasattr(os, "posix_fadvise")
    cold, tier, warm, unc, hit_tokens = [], [], [], [], []
    for i in range(len(fresh) // 2):
        p, q = fresh[2 * i], fresh[2 * i + 1]
        cold.append(_ttft(llm_off, p))
        eng.flush_cache(drop_device=True)
        h0 = st.hit_tokens
        if uncached and i % 2:
            _drop_page_cache(disk.root)
            unc.append(_ttft(llm, p))
        else:
            tier.append(_ttft(llm, p))
        hit_tokens.append(st.hit_tokens - h0)
        warm.append(_ttft(llm, q))
    cold_s, tier_s = statistics.mean(cold), statistics.mean(tier)
    out = {"ttft_cold_paired_s": round(cold_s, 4),
           "ttft_warm_paired_s": round(statistics.mean(warm), 4),
           "ttft_tier_s": round(tier_s, 4), "tier_speedup": round(cold_s / tier_s, 2),
           "tier_hit_tokens": round(statistics.mean(hit_tokens), 1)}
    if unc:
        out["ttft_tier_uncached_s"] = round(statistics.mean(unc), 4)
        out["tier_uncached_speedup"] = round(cold_s / statistics.mean(unc), 2)
    per_tier = {}
    for t, s in moved.items():
        b, n, sec = before[t]
        per_tier[t] = {"stored_bytes": s.stored_bytes, "stored_entries": s.stored_entries,
                       "loaded_bytes": s.loaded_bytes - b, "loaded_entries": s.loaded_entries - n,
                       "mean_load_ms": round(1e3 * (s.load_seconds - sec)
                                             / max(1, s.loaded_entries - n), 4)}
    out["tiers"] = per_tier
    eng.flush_cache(drop_device=True)
    out["identical_tier"] = _greedy(llm, prompts, check_tokens) == expected
    return out


def _drop_page_cache(root: Path) -> None:
    for path in root.glob("*/*/*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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
    p.add_argument("--offload", default=None, choices=("host", "disk", "host,disk"),
                   help="also time prefix hits served from this offload tier")
    p.add_argument("--offload-bytes", type=_size, default=8 << 30, help="tier cap (8GiB)")
    p.add_argument("--offload-dir", default=None,
                   help="disk tier directory (default: a temporary one, removed afterwards)")
    p.add_argument("--json", action="store_true")


def _size(text: str) -> int:
    from kdaserve.arg_types import parse_size

    return parse_size(text)


def run(args: argparse.Namespace) -> int:
    model = str(args.model or default_model_path())
    max_len = args.prefix_len + args.suffix_len + 64
    max_len = max(max_len, args.turns * (args.turn_len + args.answer_len) + 64)
    common = dict(block_size=args.block_size, cache_memory=args.cache_memory,
                  max_model_len=max_len, max_num_batched_tokens=2048)
    llm_off = LLM(model, enable_prefix_caching=False, **common)
    tmp = None
    offload = {}
    if args.offload:
        directory = args.offload_dir
        if directory is None and "disk" in args.offload:
            directory = tmp = tempfile.mkdtemp(prefix="kdaserve-offload-")
        offload = dict(offload=args.offload, offload_bytes=args.offload_bytes,
                       offload_dir=directory)
    try:
        return _run(args, model, common, llm_off, offload)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, model: str, common: dict, llm_off: LLM,
         offload: dict) -> int:
    llm_on = LLM(model, enable_prefix_caching=True, **common, **offload)
    vocab = llm_on.engine.model.config.vocab_size
    result = shared_prefix(llm_on, llm_off, args.prefix_len, args.num_suffixes, args.suffix_len,
                           vocab, args.seed, args.check_tokens)
    result["multi_turn"] = multi_turn(llm_on, llm_off, args.turns, args.turn_len,
                                      args.answer_len, vocab, args.seed)
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
