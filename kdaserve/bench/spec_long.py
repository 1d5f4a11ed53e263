"""`kdaserve bench spec --input-lens L,...`: batch-1 rows whose prompts are L tokens long
(bench/spec_prompts.py `long_prompt_ids`), timed after each prompt is in the prefix cache.

Why cached: a 64k-token prompt prefills in ~31 s on the K3 demo (2 Zen 4 cores). Prefilled
inside each timed run, it put half a minute between the two sides of every pair, while this
host's read rate moves by half over seconds: three repeats read intervals of +-7-60% on the
decode alone (docs/benchmarks.md, twenty-ninth session). Here each prompt is prefilled once,
before the timing; both sides of every pair then recompute the prompt's last block from the
same cached MLA pages and KDA state and decode, a fraction of a second to a few seconds apart,
and 30 repeats read +-2-4% (thirtieth session). The decode is the one a long prompt gets
whether it came fresh or from the cache; as after any prefix hit, the draft's context starts
at the positions the engine computed (engine/spec/dspark.py).

The rows run on engines of their own, one per verification method, over the short rows'
weights, with prefix caching on and max_model_len raised to fit the longest prompt.
"""

from __future__ import annotations

import argparse

from kdaserve.bench.spec_measure import measure, row_params, timed_run
from kdaserve.bench.spec_prompts import long_prompt_ids
from kdaserve.engine.llm import LLM


def _positions(n_in: int, args: argparse.Namespace) -> int:
    """What a row of n_in-token prompts needs: the prompt, its tokens and a verified block."""
    return n_in + args.max_tokens + args.k + 1


def long_engines(model: str, shared: LLM, methods: list[str], args: argparse.Namespace,
                 engine_kwargs: dict) -> dict[str, LLM]:
    """One prefix-caching engine per verification method, sharing `shared`'s weights."""
    room = _positions(max(args.input_lens), args)
    return {m: LLM(model, shared_weights=shared, enable_prefix_caching=True,
                   max_model_len=max(4096, room), speculative_rejection_sample_method=m,
                   **engine_kwargs) for m in methods}


def long_row(spec: LLM, n_in: int, mode: str, defaults: dict, args: argparse.Namespace
             ) -> dict:
    """Batch 1, `--num-prompts` requests whose prompts are n_in tokens long, each prefilled
    once before `--long-repeats` timed pairs."""
    limit = min(spec.engine.config.scheduler.max_model_len,
                spec.engine.model.config.max_position_embeddings)
    if _positions(n_in, args) > limit:
        return {"input_len": n_in, "skipped": f"{n_in} prompt tokens + {args.max_tokens} "
                f"generated + {args.k + 1} verified exceed the model's limit of {limit}"}
    encode = spec.tokenizer.encode
    prompts = [{"prompt_token_ids": long_prompt_ids(encode, n_in, i)}
               for i in range(args.num_prompts)]
    params = row_params(mode, defaults, args.num_prompts, args.max_tokens, args.temperature,
                        args.top_p)
    for p, sp in zip(prompts, params):      # the prefill, paid once, outside the timing
        timed_run(spec, [p], [sp])
    row = measure(spec, spec, prompts, params, 1, greedy=mode == "greedy",
                  repeats=args.long_repeats)
    row["input_len"] = n_in
    row["prompt_cached"] = True
    row["acceptance_length"] = row["mean_accepted_tokens"]
    return row
