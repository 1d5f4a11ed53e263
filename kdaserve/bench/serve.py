"""`kdaserve bench serve`: load an OpenAI-compatible server, in the style of `vllm bench serve`.

Requests go to /v1/completions with streaming, arriving as a Poisson process (or all at once for
rate inf). Prompts are random common words, so no tokenizer is needed here; `--input-len` counts
words, and the token counts reported come from the server's usage numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openai

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from "
         "at which but have an they you were her she there been one all we their has would "
         "when if so no will more what out up who them some time could into only than its "
         "other then two may like these any now over first after most such very our many "
         "made man good great world little life king queen love night day light heart hand "
         "eyes death lord sweet fair true word name father mother house")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server root URL, without /v1 (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="model name to request (default: the first one /v1/models lists)")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second, Poisson arrivals; inf sends all at once "
                        "(default: inf)")
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt length in words (about one token each) (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64,
                   help="tokens to generate per request, EOS ignored (default: %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="sample lengths uniformly in [len*(1-r), len*(1+r)]; 0 = fixed "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("KDASERVE_API_KEY"),
                   help="bearer key (default: $KDASERVE_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="per-request timeout in seconds (default: %(default)s)")
    p.add_argument("--structured", choices=("json_schema",), default=None,
                   help="run the load twice, without and with a response_format JSON schema, "
                        "and report both TPOTs and the grammar's share")
    p.add_argument("--json", action="store_true",
                   help="print only one JSON object with the results")


def _check(args: argparse.Namespace) -> str | None:
    if args.num_prompts < 1:
        return "--num-prompts must be >= 1"
    if not args.request_rate > 0:
        return "--request-rate must be > 0 (or inf)"
    if args.input_len < 1 or args.output_len < 1:
        return "--input-len and --output-len must be >= 1"
    if not 0.0 <= args.range_ratio < 1.0:
        return "--range-ratio must be in [0, 1)"
    return None


def sample_lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [rng.randint(low, high) if ratio else mean for _ in range(n)]


def random_prompt(num_words: int, rng: random.Random) -> str:
    vocab = WORDS.split()
    return " ".join(rng.choice(vocab) for _ in range(num_words))


# --structured json_schema: a schema that keeps the grammar active for the whole output
BENCH_SCHEMA = {"type": "object", "properties": {
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 48}}},
    "required": ["lines"]}


async def _one(client: openai.AsyncOpenAI, model: str, prompt: str,
               max_tokens: int, extra: dict[str, Any] | None = None) -> RequestResult:
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True,
                                                                 **(extra or {})})
        got_first = False
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if got_first:
                    result.itl_s.append(now - last)
                else:
                    got_first, result.ttft_s = True, now - start
                last = now
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
        result.latency_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens (or no usage) in the stream"
    except openai.OpenAIError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _stats_ms(values: list[float], name: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"p99_{name}_ms": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in done)
    out = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done), "errors": len(results) - len(done),
        "duration_s": duration_s, "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (inp + out) / duration_s if duration_s > 0 else 0.0,
    }
    summary.update(_stats_ms([r.ttft_s for r in done], "ttft"))
    summary.update(_stats_ms([t for r in done if (t := r.tpot_s) is not None], "tpot"))
    summary.update(_stats_ms([x for r in done for x in r.itl_s], "itl"))
    first_error = next((r.error for r in results if not r.ok), None)
    if first_error:
        summary["first_error"] = first_error
    return summary


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.structured is None:
        return await _bench_once(args, None)
    plain = await _bench_once(args, None)
    fmt = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
    guided = await _bench_once(args, {"response_format": fmt})
    without, with_ = plain["mean_tpot_ms"], guided["mean_tpot_ms"]
    return {**guided, "structured": args.structured, "errors": plain["errors"] + guided["errors"],
            "mean_tpot_without_grammar_ms": without, "mean_tpot_with_grammar_ms": with_,
            "grammar_tpot_overhead_pct": 100.0 * (with_ - without) / without if without else 0.0}


async def _bench_once(args: argparse.Namespace, extra: dict[str, Any] | None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    client = openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1",
                                api_key=args.api_key or "EMPTY", max_retries=0,
                                timeout=args.timeout)
    try:
        model = args.model or (await client.models.list()).data[0].id
        in_lens = sample_lengths(args.num_prompts, args.input_len, args.range_ratio, rng)
        out_lens = sample_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
        prompts = [random_prompt(n, rng) for n in in_lens]
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in zip(prompts, out_lens):
            tasks.append(asyncio.create_task(_one(client, model, prompt, max_tokens, extra)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        await client.close()
    summary = summarize(results, duration)
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    return {"model": model, "num_prompts": args.num_prompts, "request_rate": rate,
            "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, **summary}


def _print_table(summary: dict[str, Any]) -> None:
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def run_bench_serve(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(_bench(args))
    except openai.OpenAIError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)
    return 0 if summary["errors"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdaserve bench serve",
                                     description="load-test an OpenAI-compatible server")
    add_bench_serve_arguments(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
