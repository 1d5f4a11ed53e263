"""`kdaserve bench disagg`: prefill/decode disaggregation against colocated serving, under a
mixed load of long and short prompts.

Two ways to run the disaggregated pair:
- by default in one process, the prefill and the decode engine stepping in turn in one thread
  (kdaserve/disagg/local.py): the phases never overlap, so the timings show the mechanics only;
- with `--prefill-cpus` and `--decode-cpus`, the prefill engine in a process of its own pinned
  to its CPUs and the decode engine in this one pinned to its CPUs, running at the same time
  as two instances of a deployment do (kdaserve/disagg/split_run.py); the colocated engine then
  runs on the union of both sets (all cores for everything, as a colocated instance would).
The cache moves over a real loopback socket either way.

Reports: the bytes moved per request, split into MLA latents and KDA states; for one long
prompt alone, its prefill time and the transfer time after its last chunk (the last part and
the acknowledgements; the goal: at most 10% of the prefill), and the time its pushes took on
the engine thread while it computed; TTFT and TPOT (p50, p99; short requests' TPOT p99
apart), colocated and disaggregated, under the mixed load; the decode side's prefix-hit
savings in a chat's second turn (`turns`, kdaserve/bench/disagg_turns.py); `identical`:
greedy output equal, token for token (both turns included); and which goals held."""

from __future__ import annotations

import argparse
import json
import os

import torch

from kdaserve.assets import default_model_path
from kdaserve.bench.disagg_pair import Pair
from kdaserve.bench.disagg_turns import SCENARIOS, measure_turns, per_request
from kdaserve.config import KV_CONNECTORS
from kdaserve.disagg.local import Trace, run_colocated
from kdaserve.disagg.split_run import pin
from kdaserve.engine.llm import LLM
from kdaserve.ops.cpu_isa import cpu_model
from kdaserve.request import SamplingParams


def _cpus(text: str) -> set[int]:
    """'0', '0,1' or '0-3' -> a CPU set."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: bundled demo)")
    p.add_argument("--long-len", type=int, default=4096, help="tokens of a long prompt")
    p.add_argument("--num-long", type=int, default=2)
    p.add_argument("--short-len", type=int, default=32, help="tokens of a short prompt")
    p.add_argument("--num-short", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefill-block-size", type=int, default=16)
    p.add_argument("--decode-block-size", type=int, default=32)
    p.add_argument("--cache-memory", type=int, default=512 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-connector", choices=KV_CONNECTORS, default="zmq",
                   help="how the caches travel (nixl: read through NIXL; needs `nixl`)")
    p.add_argument("--prefill-cpus", type=_cpus, default=None, metavar="CPUS",
                   help="run the prefill engine in its own process on these CPUs (e.g. 0 or "
                   "0-3), at the same time as the decode engine; needs --decode-cpus")
    p.add_argument("--decode-cpus", type=_cpus, default=None, metavar="CPUS",
                   help="the decode engine's CPUs (this process); the colocated engine runs "
                   "on both sets")
    p.add_argument("--num-chats", type=int, default=4,
                   help="conversations of the second-turn scenarios (0: skip them)")
    p.add_argument("--chat-len", type=int, default=1024,
                   help="most tokens of a first-turn prompt (drawn from half that up)")
    p.add_argument("--turn-len", type=int, default=64,
                   help="tokens of the new user turn in a follow-up")
    p.add_argument("--json", action="store_true")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 5)


def _latency(traces: list[Trace], short: list[bool]) -> dict:
    ttft = [t.ttft for t in traces]
    tpot = [t.tpot for t in traces]
    return {"ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
            "short_tpot_p99_s": _pct([x for x, s in zip(tpot, short) if s], 0.99)}


def measure(model: str, long_len: int, num_long: int, short_len: int, num_short: int,
            max_tokens: int, prefill_block: int, decode_block: int, cache_memory: int,
            seed: int, connector: str = "zmq", prefill_cpus: set[int] | None = None,
            decode_cpus: set[int] | None = None, num_chats: int = 4, chat_len: int = 1024,
            turn_len: int = 64, engine_args: dict | None = None) -> dict:
    """`engine_args`: more LLM arguments for every engine (the tests' thread count)."""
    split = prefill_cpus is not None or decode_cpus is not None
    if split and not (prefill_cpus and decode_cpus):
        raise ValueError("--prefill-cpus and --decode-cpus go together")
    longest = max(long_len, chat_len + max_tokens + turn_len if num_chats else 0)
    common = {"cache_memory": cache_memory, "max_model_len": longest + max_tokens + 64,
              **(engine_args or {})}
    if split:
        pin(prefill_cpus | decode_cpus)
    colo = LLM(model, block_size=decode_block, enable_prefix_caching=False, **common)
    vocab = colo.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    lens = [long_len] * num_long + [short_len] * num_short
    order = torch.randperm(len(lens), generator=g).tolist()     # mixed arrival order
    lens = [lens[i] for i in order]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    lone = torch.randint(3, vocab, (long_len,), generator=g).tolist()
    short = [n == short_len for n in lens]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run_colocated(colo.engine, [prompts[0][:8]], params)                 # warm-up
    colocated = run_colocated(colo.engine, prompts, params)
    colo_threads = torch.get_num_threads()
    if split:
        pin(decode_cpus)
    dec_args = {"block_size": decode_block, "enable_prefix_caching": False,
                "kv_connector": connector, **common}
    pre_args = {**dec_args, "block_size": prefill_block}
    pair = Pair(model, pre_args, dec_args, prefill_cpus if split else None)
    dec = pair.dec
    try:
        pair.run([prompts[0][:8]], params)                              # warm-up
        (alone,), one = pair.run([lone], params)
        disagg, moved = pair.run(prompts, params)
        turns = measure_turns(model, pair, colo.engine, pre_args, dec_args, num_chats,
                              chat_len, turn_len, params, seed, _latents(dec), decode_block,
                              prefill_cpus if split else None) if num_chats else None
    finally:
        pair.close()
    n = max(1.0, moved["sent"])
    # the lone long prompt: its time to the first token on the prefill side is its chunks'
    # compute, the pushes' host copies between them, and the last part's send
    after_last = one["send_seconds"]
    prefill_s = alone.ttft - after_last
    frac = after_last / prefill_s if prefill_s > 0 else None
    errors = [t.error for t in colocated + disagg + [alone] if t.error]
    identical = not errors and [t.tokens for t in disagg] == [t.tokens for t in colocated]
    if turns is not None:
        identical = identical and all(turns[k]["identical"] for k in SCENARIOS)
    lat_c, lat_d = _latency(colocated, short), _latency(disagg, short)
    return {
        "requests": len(prompts), "long_len": long_len, "num_long": num_long,
        "short_len": short_len, "num_short": num_short, "max_tokens": max_tokens,
        "block_size": {"prefill": prefill_block, "decode": decode_block},
        "kv_connector": connector,
        "identical": identical,
        "errors": errors,
        "bytes_per_request": per_request(moved),
        "bytes_per_long_request_mla": _latents(dec) * long_len,
        "long_alone": {
            "tokens": long_len,
            "prefill_s": round(prefill_s, 5),
            "transfer_after_last_chunk_s": round(after_last, 5),
            "transfer_after_last_chunk_frac": round(frac, 4) if frac is not None else None,
            "push_s_on_engine_thread": round(one["push_seconds"], 5),
            "parts_pushed": int(one["parts_pushed"]),
            "prefill_steps": int(one["steps"]),
        },
        "mixed": {"parts_pushed": int(moved["parts_pushed"]),
                  "push_s_per_request": round(moved["push_seconds"] / n, 5),
                  "transfer_after_last_chunk_s_per_request":
                      round(moved["send_seconds"] / n, 5),
                  "prefill_steps": int(moved["steps"])},
        "decode_prefix_hit_tokens": int(moved["decode_hit_tokens"]),
        "turns": turns,
        "colocated": lat_c,
        "disaggregated": lat_d,
        "goals": {
            "identical": identical,
            "transfer_after_last_chunk_le_10pct_of_prefill":
                frac is not None and frac <= 0.10,
            "short_tpot_p99_lower_disaggregated":
                lat_d["short_tpot_p99_s"] < lat_c["short_tpot_p99_s"],
        },
        "mode": "processes" if split else "in_turn",
        "cpus": {"prefill": sorted(prefill_cpus), "decode": sorted(decode_cpus),
                 "colocated": sorted(prefill_cpus | decode_cpus)} if split else None,
        "threads": {"colocated": colo_threads, "decode": torch.get_num_threads(),
                    "prefill": len(prefill_cpus) if split else torch.get_num_threads()},
        "cpu": cpu_model(), "os_cpus": os.cpu_count(),
        "note": ("prefill and decode in separate processes on their own CPUs, at the same "
                 "time (one machine: shared memory bandwidth and caches); colocated on both "
                 "sets" if split else
                 "prefill and decode engines step in turn in one thread: their phases never "
                 "overlap, so the timings show the mechanics only"),
    }


def _latents(llm: LLM) -> int:
    """MLA latent bytes per token (all MLA layers)."""
    return sum(p[0, 0].numel() * p.element_size() for p in llm.engine.runner.cache.mla_pages)


def run(args: argparse.Namespace) -> int:
    result = measure(str(args.model or default_model_path()), args.long_len, args.num_long,
                     args.short_len, args.num_short, args.max_tokens, args.prefill_block_size,
                     args.decode_block_size, args.cache_memory, args.seed, args.kv_connector,
                     args.prefill_cpus, args.decode_cpus, args.num_chats, args.chat_len,
                     args.turn_len)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if result["identical"] else 1
