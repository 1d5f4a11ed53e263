"""`kdaserve serve | generate | inspect | quantize | bench | train | extract-hidden |
train-draft`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any


def _generate_args(p: argparse.ArgumentParser) -> None:
    from kdaserve.engine.engine_flags import add_engine_arguments

    p.add_argument("prompt", help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation_config.json, else 1.0")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    # --seed is the sampling seed here (its own dest, so EngineArgs.from_cli leaves the
    # engine's seed at its default)
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None)
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_arguments(p.add_argument_group("engine (the same settings as LLM(...))"),
                         exclude=("seed",))


def _run_generate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kdaserve.engine.args import EngineArgs
    from kdaserve.engine.llm import LLM
    from kdaserve.generation_defaults import sampling_params_with_defaults

    llm = LLM(**asdict(EngineArgs.from_cli(args)))     # a torchrun rank > 0 ends in here
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    fields = {"max_tokens": args.max_tokens, "top_k": args.top_k, "seed": args.sampling_seed,
              "temperature": 0.0 if args.greedy else args.temperature,
              "top_p": args.top_p, "repetition_penalty": args.repetition_penalty}
    params = sampling_params_with_defaults(llm.config.model, fields)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    sys.stdout.write(prompt + out.text + "\n")
    llm.shutdown()
    return 0


Filler = Callable[[argparse.ArgumentParser], None]


def _from(module: str, name: str = "add_arguments") -> Filler:
    """A subcommand's flag builder, imported only when that subcommand is chosen."""
    def fill(parser: argparse.ArgumentParser) -> None:
        getattr(importlib.import_module(module), name)(parser)

    return fill


class _LazySubParsers(argparse._SubParsersAction):
    """Subcommands whose flags are added only once the command line names them: most of them
    import torch (seconds), which `kdaserve --help` or another subcommand must not pay for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fillers: dict[str, Filler] = {}

    def add_lazy(self, name: str, help: str, fill: Filler) -> argparse.ArgumentParser:
        parser = self.add_parser(name, help=help)
        self._fillers[name] = fill
        return parser

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        fill = self._fillers.pop(values[0], None)
        if fill is not None:
            fill(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdaserve", description="Serve hybrid KDA + MLA MoE models.")
    sub = p.add_subparsers(dest="command", required=True, action=_LazySubParsers)
    sub.add_lazy("serve", "OpenAI-compatible HTTP server (default: bundled demo on "
                 "127.0.0.1:8000)", _from("kdaserve.server.args", "add_serve_arguments"))
    sub.add_lazy("proxy", "OpenAI-compatible front of prefill and decode instances "
                 "(disaggregated serving)", _from("kdaserve.disagg.proxy_cli"))
    sub.add_lazy("generate", "one-shot generation from a prompt", _generate_args)
    sub.add_lazy("inspect", "parameter counts and cache sizes of a config, without weights",
                 _from("kdaserve.model.inspect"))
    sub.add_lazy("plan", "a deployment's fit, speed and cost on paper (hardware table); "
                 "--simulate its serving with the engine's scheduler, --calibrate the simulator",
                 _from("kdaserve.plan.cli"))
    sub.add_lazy("quantize", "write a float checkpoint as an INT8/INT4 compressed-tensors one",
                 _from("kdaserve.model.quantize_cli"))
    sub.add_lazy("bench", "benchmarks (JSON output)", _bench_args)
    sub.add_lazy("train", "train the demo model from its corpus", _from("kdaserve.train.demo"))
    sub.add_lazy("extract-hidden", "target hidden states over a corpus, for draft training",
                 _from("kdaserve.train.draft_data", "add_extract_arguments"))
    sub.add_lazy("train-draft", "train the DSpark draft on extract-hidden shards",
                 _from("kdaserve.train.draft", "add_train_draft_arguments"))
    return p


def _bench_args(bench: argparse.ArgumentParser) -> None:
    bsub = bench.add_subparsers(dest="bench", required=True, action=_LazySubParsers)
    for name, help, fill in [
        ("offline", "offline throughput vs transformers", _from("kdaserve.bench.offline")),
        ("prefix", "shared-prefix TTFT, caching off vs on", _from("kdaserve.bench.prefix")),
        ("disagg", "prefill/decode disaggregation vs colocated: bytes, transfer time, "
         "TTFT/TPOT, second-turn decode-side prefix hits, identical output",
         _from("kdaserve.bench.disagg")),
        ("spec", "speculative decoding vs plain decode", _from("kdaserve.bench.spec")),
        ("kda", "KDA recurrence: torch vs compiled CPU kernel", _from("kdaserve.bench.kda")),
        ("reference", "model vs transformers, fla-core (kimi_linear) or mlx-lm (kimi_k3)",
         _from("kdaserve.bench.reference")),
        ("long", "cost against context length, to 1M", _from("kdaserve.bench.long")),
        ("moe", "MoE backends (reference, grouped, tp_sharded, ep_all2all) side by side",
         _from("kdaserve.bench.moe")),
        ("compare", "kdaserve vs llama.cpp, same model", _from("kdaserve.bench.compare")),
        ("blocks", "a CPU decode step's time per fused block", _from("kdaserve.bench.blocks")),
        ("cuda", "the CUDA path: checks and timings", _from("kdaserve.bench.cuda.cli")),
        ("serve", "load generator for a server",
         _from("kdaserve.bench.serve", "add_bench_serve_arguments")),
    ]:
        bsub.add_lazy(name, help, fill)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from kdaserve.server.cli import run_serve

        return run_serve(args)          # configures logging itself (--log-level, timestamps)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "proxy":
        from kdaserve.disagg.proxy_cli import run as run_proxy

        return run_proxy(args)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "inspect":
        from kdaserve.model.inspect import run as run_inspect

        return run_inspect(args)
    if args.command == "plan":
        from kdaserve.plan.cli import run as run_plan

        return run_plan(args)
    if args.command == "quantize":
        from kdaserve.model.quantize_cli import run as run_quantize

        return run_quantize(args)
    if args.command == "bench":
        if args.bench == "offline":
            from kdaserve.bench.offline import run

            return run(args)
        if args.bench == "reference":
            from kdaserve.bench.reference import run as run_reference

            return run_reference(args)
        if args.bench == "disagg":
            from kdaserve.bench.disagg import run as run_disagg

            return run_disagg(args)
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
        if args.bench == "blocks":
            from kdaserve.bench.blocks import run as run_blocks

            return run_blocks(args)
        if args.bench == "moe":
            from kdaserve.bench.moe import run as run_moe

            return run_moe(args)
        if args.bench == "cuda":
            from kdaserve.bench.cuda.cli import run as run_cuda

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
