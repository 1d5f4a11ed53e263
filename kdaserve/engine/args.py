"""`EngineArgs`: the engine's user-facing settings, one field each, with their defaults and help.

`LLM(...)`, `kdaserve serve`, `kdaserve generate` and the benches all go through it, and
`to_engine_config` is the only place that maps settings to `EngineConfig`, so the offline and
the served engine cannot drift apart. engine/engine_flags.py makes the command-line flags from
the fields (`--field-name`; older spellings kept as aliases). Plain Python: building a parser
must not import torch (`kdaserve --help` stays fast).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kdaserve import arg_types
from kdaserve.config import (
    EXECUTORS,
    KV_CONNECTORS,
    MOE_BACKENDS,
    ROLES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    json_flag,
)
from kdaserve.engine.dtypes import packed_int_weights, resolve_dtype

DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("dspark", "ngram")
QUANTIZATIONS = ("int8", "int4")


def _arg(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
         choices: Sequence[str] | None = None, aliases: tuple[str, ...] = (),
         metavar: str | None = None, shown: str | None = None) -> Any:
    """A field with its flag's help. `parse`: the flag's value type (default: from the
    annotation); `aliases`: older flag spellings that must keep working; `shown`: the default
    as the help prints it."""
    return field(default=default, metadata={
        "help": help, "parse": parse, "choices": choices, "aliases": aliases,
        "metavar": metavar, "shown": shown})


@dataclass
class EngineArgs:
    """Defaults: where `LLM(...)` and `kdaserve serve` used to differ, the cache was 256 MiB
    offline and 512 MiB served; both are now 512 MiB (CacheConfig's own default)."""

    model: str | None = _arg(None, "model directory (config.json, *.safetensors, tokenizer "
                             "files); default: the bundled demo model", metavar="PATH")
    dtype: str = _arg("auto", "weight and activation dtype; auto: bfloat16 on CUDA, float32 on "
                      "CPU (KDA states stay float32 either way)", choices=DTYPES)
    device: str = _arg("cpu", "torch device, e.g. cpu or cuda")
    kda_chunk_size: int | None = _arg(None, "KDA prefill chunk size (default: 64 on GPU, 16 "
                                      "on CPU)", parse=arg_types.positive_int)
    quantization: str | None = _arg(
        None, "quantize the float weights on load, weight-only with group-wise scales: int8 "
        "or int4 (dense projections, shared and routed experts, the LM head; the embedding "
        "stays); a compressed-tensors checkpoint is read as stored", choices=QUANTIZATIONS)
    quantization_group_size: int = _arg(128, "input columns per scale of --quantization "
                                        "(32 to 128 typical)",
                                        parse=arg_types.int_at_least(2))
    seed: int = _arg(0, "engine random seed")
    async_scheduling: bool = _arg(False, "plan each step while the one before still runs "
                                  "(the sampled tokens come back as the next is planned); not "
                                  "with speculative decoding or worker processes")
    enforce_eager: bool = _arg(False, "on CUDA, run decode steps eagerly instead of replaying "
                               "the CUDA graphs captured at startup")
    num_threads: int | None = _arg(None, "torch intra-op threads of the engine process "
                                   "(default: torch's)", parse=arg_types.positive_int,
                                   aliases=("--torch-threads",))
    # scheduler
    max_num_seqs: int = _arg(64, "most requests in one batch; also the number of KDA state "
                             "slots", parse=arg_types.positive_int)
    max_num_batched_tokens: int = _arg(2048, "token budget of one engine step",
                                       parse=arg_types.positive_int)
    max_model_len: int = _arg(4096, "longest prompt + completion in tokens",
                              parse=arg_types.positive_int)
    long_prefill_token_threshold: int | None = _arg(
        None, "most prompt tokens one request prefills in a step (default: the step's "
        "budget)", parse=arg_types.positive_int)
    max_decode_slowdown: float = _arg(
        2.0, "while requests decode, a step carries only as much of long prompts' prefill as "
        "keeps it within this many times its cost without them (measured on this machine); "
        "0: no limit (vLLM's behaviour)", parse=arg_types.slowdown)
    num_scheduler_steps: int = _arg(
        4, "a batch that only decodes runs up to this many forwards per scheduling decision "
        "(within ~40 ms; not for requests with grammars or stop strings, nor with fixed "
        "speculation, async scheduling, worker processes or disaggregation; adaptive "
        "speculation: while its drafter sleeps); 1: one step at a time",
        parse=arg_types.positive_int)
    # cache
    cache_memory: int = _arg(512 << 20, "memory for MLA pages and KDA state slots, e.g. "
                             "256MiB, 1GiB or bytes", parse=arg_types.parse_size,
                             shown="512MiB")
    gpu_memory_utilization: float | None = _arg(
        None, "on CUDA, size the cache as this fraction of the GPU's memory less what is in "
        "use after loading the weights, e.g. 0.9 (--cache-memory is used on CPU)",
        parse=arg_types.fraction)
    block_size: int = _arg(16, "tokens per MLA cache block, a power of two",
                           parse=arg_types.positive_int)
    kv_cache_dtype: str = _arg("auto", "the MLA latent cache: auto (the model's dtype) or fp8 "
                               "(e4m3 with a scale per token: about half of bf16's bytes)",
                               choices=("auto", "fp8"))
    num_blocks: int | None = _arg(None, "MLA cache blocks (default: what --cache-memory "
                                  "leaves after the state slots)", parse=arg_types.positive_int)
    enable_prefix_caching: bool = _arg(True, "hybrid prefix caching (MLA blocks + KDA state "
                                       "snapshots)", aliases=("--prefix-caching",))
    state_snapshot_budget: int | float | None = _arg(
        None, "memory for KDA state snapshots: bytes (e.g. 64MiB) or a fraction of "
        "--cache-memory (e.g. 0.25, the default)", parse=arg_types.size_or_fraction)
    state_snapshot_interval: int = _arg(512, "also snapshot KDA states every N tokens of "
                                        "long prompts", parse=arg_types.positive_int)
    offload: str | Sequence[str] | None = _arg(
        None, "keep evicted prefix-cache entries in host memory, on disk, or both (host,disk: "
        "host in front of disk; default: off)", parse=arg_types.offload_tiers)
    offload_bytes: int | Sequence[int] | None = _arg(
        None, "offload tier cap, e.g. 8GiB, or one per tier: 8GiB,50GiB (default: 4GiB host, "
        "16GiB disk)", parse=arg_types.offload_sizes)
    offload_dir: str | None = _arg(None, "directory of the disk tier; entries survive "
                                   "restarts with the same model and cache layout")
    # speculative decoding
    speculative_method: str | None = _arg(
        None, "speculative decoding: the DSpark draft fed by the target's hidden states, or "
        "n-gram prompt lookup (default: off)", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = _arg(7, "drafts verified per step",
                                       parse=arg_types.positive_int,
                                       aliases=("--speculative-tokens",))
    speculative_model: str | None = _arg(None, "DSpark draft directory (default: "
                                         "<model>/draft)")
    speculative_adaptive: bool = _arg(
        True, "choose the drafts verified per request and step from measured acceptance and "
        "step cost, speculation off where it does not pay")
    speculative_draft_sample_method: str = _arg(
        "probabilistic", "the draft samples its tokens from its processed distribution "
        "(verified against it) or takes its argmax", choices=("probabilistic", "greedy"))
    speculative_rejection_sample_method: str = _arg(
        "block", "verify the drafted block at once (never fewer accepted in expectation, the "
        "target's distribution), or one draft at a time",
        choices=("token", "block"))
    speculative_config: str | None = _arg(
        None, "vLLM's JSON form, e.g. '{\"method\": \"dspark\", \"num_speculative_tokens\": "
        "7, \"draft_sample_method\": \"probabilistic\", \"rejection_sample_method\": "
        "\"block\"}' (keys: method, model, num_speculative_tokens, draft_sample_method, "
        "rejection_sample_method); it sets the flags above", metavar="JSON")
    # parallelism (docs/parallelism.md)
    tensor_parallel_size: int = _arg(1, "ranks that shard attention heads, MLPs and the "
                                     "vocabulary, one process each",
                                     parse=arg_types.positive_int)
    expert_parallel_size: int = _arg(1, "ranks the routed experts are partitioned over (1 or "
                                     "equal to --tensor-parallel-size)",
                                     parse=arg_types.positive_int)
    data_parallel_size: int = _arg(1, "attention data parallel with expert-parallel MoE (DEP): "
                                   "each rank runs attention for its own requests; needs "
                                   "--expert-parallel-size equal to it",
                                   parse=arg_types.positive_int)
    pipeline_parallel_size: int = _arg(1, "pipeline stages: the decoder layers split across "
                                       "this many ranks, several micro-batches in flight; with "
                                       "the other parallel sizes 1", parse=arg_types.positive_int)
    moe_backend: str = _arg("auto", "how routed experts run; auto picks by topology and logs "
                            "why", choices=MOE_BACKENDS)
    # prefill/decode disaggregation (docs/disaggregation.md)
    role: str | None = _arg(None, "disaggregated serving: this instance computes prompts and "
                            "pushes their caches (prefill) or takes them in and decodes "
                            "(decode); default: both, colocated", choices=ROLES)
    kv_transfer_port: int | None = _arg(None, "with --role decode: the port prefill instances "
                                        "push caches to", parse=arg_types.positive_int)
    kv_transfer_host: str = _arg("127.0.0.1", "with --role decode: the address to receive "
                                 "caches on (and the one peers are told)")
    kv_transfer_timeout: float = _arg(10.0, "seconds a cache send waits for its "
                                      "acknowledgement, and a decode request for its cache")
    kv_transfer_ttl: float = _arg(60.0, "with --role decode: seconds an arrived cache waits "
                                  "for its request before it is dropped")
    kv_connector: str = _arg("zmq", "how caches travel: raw frames on the ZeroMQ channel, or "
                             "read by the decode side through NIXL (needs `nixl`: pip install "
                             "'kdaserve[disagg]'); both sides must use the same",
                             choices=KV_CONNECTORS)
    kv_transfer_config: str | None = _arg(
        None, "vLLM's JSON form, e.g. '{\"kv_connector\": \"NixlConnector\", \"kv_role\": "
        "\"kv_both\"}' (keys: kv_connector, kv_role, kv_ip, kv_port); it sets the flags above",
        metavar="JSON")
    distributed_executor: str | None = _arg(
        None, "in-process (one rank), one spawned process per rank (mp), the ranks torchrun "
        "started, or one Ray actor per rank (ray) (default: torchrun's ranks under torchrun, "
        "else uni for one rank, else mp)", choices=EXECUTORS)
    ray_address: str | None = _arg(None, "with --distributed-executor ray: the cluster to "
                                   "join, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else a "
                                   "local cluster)")

    @classmethod
    def from_kwargs(cls, caller: str = "EngineArgs", **kwargs: Any) -> EngineArgs:
        """Like the constructor, but an unknown name is a TypeError that says which one and who
        was called (`LLM()` rather than the dataclass nobody called by hand)."""
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"{caller} got unexpected keyword argument(s): "
                            f"{', '.join(map(repr, unknown))}")
        return cls(**kwargs)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The fields from parsed flags; a field without a flag (a subcommand that leaves
        some out) keeps its default."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)
                      if hasattr(namespace, f.name)})

    def _speculative(self) -> SpeculativeConfig | None:
        """The speculative settings: the flags, with --speculative-config's keys over them."""
        spec = {"speculative_method": self.speculative_method,
                "speculative_model": self.speculative_model,
                "num_speculative_tokens": self.num_speculative_tokens,
                "speculative_draft_sample_method": self.speculative_draft_sample_method,
                "speculative_rejection_sample_method": self.speculative_rejection_sample_method}
        if self.speculative_config:
            spec.update(speculative_from_json(self.speculative_config))
        if not spec["speculative_method"]:
            return None
        return SpeculativeConfig(
            method=spec["speculative_method"],
            num_speculative_tokens=spec["num_speculative_tokens"],
            draft_model=spec["speculative_model"], adaptive=self.speculative_adaptive,
            draft_sample_method=spec["speculative_draft_sample_method"],
            rejection_sample_method=spec["speculative_rejection_sample_method"])

    def to_engine_config(self) -> EngineConfig:
        from kdaserve.assets import default_model_path
        from kdaserve.disagg.kv_config import kv_transfer_config

        offload = self.offload
        tiers = tuple(t.strip() for t in (offload.split(",") if isinstance(offload, str)
                                          else offload or ()) if t.strip())
        sizes = self.offload_bytes
        caps = (sizes,) if isinstance(sizes, int) else tuple(sizes or ())
        budget = self.state_snapshot_budget
        if isinstance(budget, float):         # a fraction of the cache
            budget = int(budget * self.cache_memory)
        return EngineConfig(
            model=str(self.model) if self.model is not None else str(default_model_path()),
            dtype=resolve_dtype(self.dtype, self.device, packed_int_weights(
                self.quantization, self.model or default_model_path())),
            device=self.device, kda_chunk_size=self.kda_chunk_size,
            seed=self.seed, num_threads=self.num_threads, enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling, quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    expert_parallel_size=self.expert_parallel_size,
                                    data_parallel_size=self.data_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    moe_backend=self.moe_backend,
                                    distributed_executor=self.distributed_executor,
                                    ray_address=self.ray_address),
            cache=CacheConfig(block_size=self.block_size, cache_memory_bytes=self.cache_memory,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              num_blocks=self.num_blocks,
                              enable_prefix_caching=self.enable_prefix_caching,
                              state_snapshot_budget_bytes=budget,
                              state_snapshot_interval=self.state_snapshot_interval,
                              offload_tiers=tiers, offload_bytes=caps,
                              offload_dir=str(self.offload_dir) if self.offload_dir else None,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                max_decode_slowdown=self.max_decode_slowdown,
                num_scheduler_steps=self.num_scheduler_steps),
            speculative=self._speculative(),
            kv_transfer=kv_transfer_config(
                self.role, self.kv_transfer_port, self.kv_transfer_host,
                self.kv_transfer_timeout, self.kv_transfer_ttl, self.kv_connector,
                self.kv_transfer_config),
        )


SPECULATIVE_JSON_KEYS = {"method": "speculative_method", "model": "speculative_model",
                         "num_speculative_tokens": "num_speculative_tokens",
                         "draft_sample_method": "speculative_draft_sample_method",
                         "rejection_sample_method": "speculative_rejection_sample_method"}


def speculative_from_json(text: str) -> dict[str, Any]:
    """--speculative-config's JSON as EngineArgs fields (vLLM's keys)."""
    raw = json_flag(text, "--speculative-config", sorted(SPECULATIVE_JSON_KEYS))
    return {SPECULATIVE_JSON_KEYS[k]: v for k, v in raw.items()}
