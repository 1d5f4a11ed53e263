"""`kdaserve serve | generate | inspect | bench | train | extract-hidden | train-draft`."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--model", default=None, help="model directory (default: bundled demo model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation_config.json, else 1.0")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    from kdaserve.config import EXECUTORS

    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--expert-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--distributed-executor", choices=EXECUTORS, default=None,
                   help="default: torchrun's ranks under torchrun, else uni for one rank, "
                        "else mp (docs/parallelism.md)")
    p.add_argument("--ray-address", default=None, help="with --distributed-executor ray")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's)")


def _run_generate(args: argparse.Namespace) -> int:
    from kdaserve.engine.llm import LLM
    from kdaserve.generation_defaults import sampling_params_with_defaults

    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
              expert_parallel_size=args.expert_parallel_size,
              data_parallel_size=args.data_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size,
              distributed_executor=args.distributed_executor, ray_address=args.ray_address,
              num_threads=args.torch_threads)     # a torchrun rank > 0 ends in here
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    fields = {"max_tokens": args.max_tokens, "top_k": args.top_k, "seed": args.seed,
              "temperature": 0.0 if args.greedy else args.temperature,
              "top_p": args.top_p, "repetition_penalty": args.repetition_penalty}
    params = sampling_params_with_defaults(llm.config.model, fields)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    sys.stdout.write(prompt + out.text + "\n")
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdaserve", description="Serve hybrid KDA + MLA MoE models.")
    sub = p.add_subparsers(dest="command", required=True)

    from kdaserve.server.cli import add_serve_arguments

    add_serve_arguments(sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (default: bundled demo on 127.0.0.1:8000)"))
    _generate_args(sub.add_parser("generate", help="one-shot generation from a prompt"))
    from kdaserve.model.inspect import add_arguments as add_inspect_arguments

    add_inspect_arguments(sub.add_parser(
        "inspect", help="parameter counts and cache sizes of a config, without weights"))

    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from kdaserve.bench import offline

    from kdaserve.bench import kda, prefix, reference, spec

    offline.add_arguments(bsub.add_parser("offline", help="offline throughput vs transformers"))
    prefix.add_arguments(bsub.add_parser("prefix", help="shared-prefix TTFT, caching off vs on"))
    spec.add_arguments(bsub.add_parser("spec", help="speculative decoding vs plain decode"))
    kda.add_arguments(bsub.add_parser("kda", help="KDA recurrence: torch vs compiled CPU kernel"))
    reference.add_arguments(bsub.add_parser(
        "reference", help="model vs transformers, fla-core (kimi_linear) or mlx-lm (kimi_k3)"))
    from kdaserve.bench import long as bench_long
    bench_long.add_arguments(bsub.add_parser("long", help="cost against context length, to 1M"))
    from kdaserve.bench import moe as bench_moe
    bench_moe.add_arguments(bsub.add_parser(
        "moe", help="MoE backends (reference, grouped, tp_sharded, ep_all2all) side by side"))
    from kdaserve.bench import compare
    compare.add_arguments(bsub.add_parser("compare", help="kdaserve vs llama.cpp, same model"))
    from kdaserve.bench import cuda as bench_cuda
    bench_cuda.add_arguments(bsub.add_parser("cuda", help="the CUDA path: checks and timings"))
    try:
        from kdaserve.bench.serve import add_bench_serve_arguments
    except ImportError:  # pragma: no cover - lands with the server
        pass
    else:
        add_bench_serve_arguments(bsub.add_parser("serve", help="load generator for a server"))

    from kdaserve.train.demo import add_arguments as add_train_arguments

    add_train_arguments(sub.add_parser("train", help="train the demo model from its corpus"))
    from kdaserve.train.draft import add_train_draft_arguments
    from kdaserve.train.draft_data import add_extract_arguments

    add_extract_arguments(sub.add_parser(
        "extract-hidden", help="target hidden states over a corpus, for draft training"))
    add_train_draft_arguments(sub.add_parser(
        "train-draft", help="train the DSpark draft on extract-hidden shards"))
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from kdaserve.server.cli import run_serve

        return run_serve(args)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "inspect":
        from kdaserve.model.inspect import run as run_inspect

        return run_inspect(args)
    if args.command == "bench":
        if args.bench == "offline":
            from kdaserve.bench.offline import run

            return run(args)
        if args.bench == "reference":
            from kdaserve.bench.reference import run as run_reference

            return run_reference(args)
        if args.bench == "prefix":
            from kdaserve.bench.prefix import run as run_prefix

            return run_prefix(args)
        if args.bench == "kda":
            from kdaserve.bench.kda import run as run_kda

            return run_kda(args)
        if args.bench == "long":
            from kdaserve.bench.long import run as run_long

            return run_long(args)
        if args.bench == "compare":
            from kdaserve.bench.compare import run as run_compare

            return run_compare(args)
        if args.bench == "moe":
            from kdaserve.bench.moe import run as run_moe

            return run_moe(args)
        if args.bench == "cuda":
            from kdaserve.bench.cuda import run as run_cuda

            return run_cuda(args)
        if args.bench == "spec":
            from kdaserve.bench.spec import run as run_spec

            return run_spec(args)
        if args.bench == "serve":
            from kdaserve.bench.serve import run_bench_serve

            return run_bench_serve(args)
    if args.command == "train":
        from kdaserve.train.demo import run

        return run(args)
    if args.command == "extract-hidden":
        from kdaserve.train.draft_data import run_extract

        return run_extract(args)
    if args.command == "train-draft":
        from kdaserve.train.draft import run_train_draft

        return run_train_draft(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
