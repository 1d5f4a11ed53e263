"""`kdaserve bench disagg`: prefill/decode disaggregation against colocated serving, under a
mixed load of long and short prompts, in one process (kdaserve/disagg/local.py: a prefill and
a decode engine stepping in turn, the cache moving over a real loopback socket).

Reports, per request: the bytes moved, split into MLA latents and KDA states; the transfer
time against the prefill time; TTFT and TPOT (p50, p99; short requests' TPOT p99 apart),
colocated and disaggregated; the decode side's prefix-hit tokens; and `identical`: greedy
output equal, token for token. Both engines share this machine's cores here, so the timings
show the mechanics, not what two machines would do; `identical` and the byte counts hold
anywhere."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kdaserve.assets import default_model_path
from kdaserve.config import KV_CONNECTORS
from kdaserve.disagg.local import Trace, run_colocated, run_disaggregated
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams


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
            seed: int, connector: str = "zmq") -> dict:
    common = {"cache_memory": cache_memory, "max_model_len": long_len + max_tokens + 64}
    colo = LLM(model, block_size=decode_block, enable_prefix_caching=False, **common)
    pre = LLM(model, block_size=prefill_block, role="prefill", enable_prefix_caching=False,
              kv_connector=connector, **common)
    dec = LLM(model, block_size=decode_block, role="decode", kv_transfer_port=0,
              enable_prefix_caching=False, kv_connector=connector, **common)
    try:
        vocab = colo.engine.model_config.vocab_size
        g = torch.Generator().manual_seed(seed)
        lens = [long_len] * num_long + [short_len] * num_short
        order = torch.randperm(len(lens), generator=g).tolist()     # mixed arrival order
        lens = [lens[i] for i in order]
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        short = [n == short_len for n in lens]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        run_colocated(colo.engine, [prompts[0][:8]], params)                 # warm-up
        run_disaggregated(pre.engine, dec.engine, [prompts[0][:8]], params)
        conn, times = pre.engine.transfer.connector.stats, pre.engine.transfer.times
        sent0 = (conn.sent, conn.sent_mla_bytes, conn.sent_kda_bytes, times.send_seconds)
        steps0 = pre.engine.stats.steps
        colocated = run_colocated(colo.engine, prompts, params)
        disagg = run_disaggregated(pre.engine, dec.engine, prompts, params)
        n = max(1, conn.sent - sent0[0])
        send_s = times.send_seconds - sent0[3]
        # prefill time: each request's time to its first token on the prefill side, less the
        # sends it waited for (they run between steps)
        prefill_s = sum(t.ttft for t in disagg) / len(disagg) - send_s / n
        errors = [t.error for t in colocated + disagg if t.error]
        return {
            "requests": len(prompts), "long_len": long_len, "num_long": num_long,
            "short_len": short_len, "num_short": num_short, "max_tokens": max_tokens,
            "block_size": {"prefill": prefill_block, "decode": decode_block},
            "kv_connector": connector,
            "identical": not errors and [t.tokens for t in disagg] == [t.tokens for t in
                                                                       colocated],
            "errors": errors,
            "bytes_per_request": {"mla": (conn.sent_mla_bytes - sent0[1]) // n,
                                  "kda": (conn.sent_kda_bytes - sent0[2]) // n},
            "bytes_per_long_request_mla": _latents(pre) * long_len,
            "parts_pushed": conn.parts_pushed,       # while prompts were still computing
            "transfer_s_per_request": round(send_s / n, 5),
            "prefill_s_per_request": round(prefill_s, 5),
            # send time (pushes, the last part, waiting for acknowledgements) over prefill time
            "transfer_after_prefill_frac": round(send_s / n / prefill_s, 4) if prefill_s > 0
            else None,
            "decode_prefix_hit_tokens": dec.engine.cache.stats.hit_tokens,
            "prefill_steps": pre.engine.stats.steps - steps0,
            "colocated": _latency(colocated, short),
            "disaggregated": _latency(disagg, short),
            "note": "both engines share this machine's cores: timings show the mechanics only",
            "threads": torch.get_num_threads(),
        }
    finally:
        for e in (pre, dec):
            e.engine.transfer.connector.close()


def _latents(llm: LLM) -> int:
    """MLA latent bytes per token (all MLA layers)."""
    return sum(p[0, 0].numel() * p.element_size() for p in llm.engine.runner.cache.mla_pages)


def run(args: argparse.Namespace) -> int:
    result = measure(str(args.model or default_model_path()), args.long_len, args.num_long,
                     args.short_len, args.num_short, args.max_tokens, args.prefill_block_size,
                     args.decode_block_size, args.cache_memory, args.seed, args.kv_connector)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0 if result["identical"] else 1
