"""Frozen, validated configuration records of the engine: cache, scheduler, speculation,
parallel layout. The model's architecture is `kdaserve.model_config.ModelConfig`, read from an
HF config.json by `kdaserve.model.registry.load_config`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config field is unknown, missing, or inconsistent; the message names the field."""


def json_flag(text: str, flag: str, known: Sequence[str]) -> dict[str, Any]:
    """A flag's JSON object (vLLM's --speculative-config, --kv-transfer-config), its keys
    among `known`; anything else is a ConfigError naming the flag."""
    import json

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{flag}: unknown keys {unknown} (known: {list(known)})")
    return raw


@dataclass(frozen=True)
class CacheConfig:
    """How the hybrid cache is sized and shared."""

    block_size: int = 16
    cache_memory_bytes: int = 512 << 20
    # On CUDA: this fraction of the device's memory, less what is in use after loading, sizes
    # the cache instead of cache_memory_bytes (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float | None = None
    num_blocks: int | None = None
    num_state_slots: int | None = None
    enable_prefix_caching: bool = True
    state_snapshot_budget_bytes: int | None = None
    state_snapshot_interval: int = 512
    # Offload tiers for evicted prefix-cache entries, fastest first: ("host",), ("disk",) or
    # ("host", "disk"); one byte cap per tier (or one for all); the disk tier's directory.
    offload_tiers: tuple[str, ...] = ()
    offload_bytes: tuple[int, ...] = ()
    offload_dir: str | None = None
    # the MLA latent cache: "auto" (the model's dtype) or "fp8" (e4m3, a scale per token)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self._check_offload()
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.cache_memory_bytes <= 0:
            raise ConfigError("cache memory must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be >= 1")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ConfigError("num_state_slots must be >= 1")

    def _check_offload(self) -> None:
        tiers = tuple(self.offload_tiers)
        if not tiers:
            return
        if tiers not in (("host",), ("disk",), ("host", "disk")):
            raise ConfigError(f"offload tiers must be host, disk or host,disk, got {tiers}")
        if not self.enable_prefix_caching:
            raise ConfigError("offload keeps prefix-cache entries: it needs prefix caching on")
        if "disk" in tiers and not self.offload_dir:
            raise ConfigError("the disk offload tier needs a directory (offload_dir)")
        if len(self.offload_bytes) not in (0, 1, len(tiers)):
            raise ConfigError(f"give one offload size, or one per tier ({len(tiers)})")
        if any(b <= 0 for b in self.offload_bytes):
            raise ConfigError("offload sizes must be positive")

    def offload_capacities(self) -> tuple[int, ...]:
        """Bytes per offload tier (default: 4 GiB of host memory, 16 GiB of disk)."""
        given = tuple(self.offload_bytes)
        if len(given) == 1:
            given *= len(self.offload_tiers)
        return given or tuple(4 << 30 if t == "host" else 16 << 30 for t in self.offload_tiers)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int | None = None
    policy: str = "fcfs"
    # a step that others decode in carries at most what keeps it within this many times its
    # cost without the long prompts' chunks (engine/decode_guard.py); 0: no limit
    max_decode_slowdown: float = 2.0
    # a batch that only decodes runs up to this many forwards per scheduling decision
    # (engine/decode_burst.py); 1: one step at a time
    num_scheduler_steps: int = 4

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.num_scheduler_steps < 1:
            raise ConfigError("num_scheduler_steps must be >= 1")
        if self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
        if self.max_decode_slowdown and self.max_decode_slowdown < 1.0:
            raise ConfigError("max_decode_slowdown must be >= 1 (or 0: no limit)")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes drafts and how many per step.

    method "dspark": the block drafter fed by the target's hidden states (`draft_model` is its
    directory; default: the `draft/` folder next to the target's weights). method "ngram":
    prompt lookup, no model (the longest earlier match of the last `ngram_max`..`ngram_min`
    tokens proposes what followed it).
    """

    method: str = "dspark"
    num_speculative_tokens: int = 7
    draft_model: str | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    # per request and step, verify only the drafts that pay for themselves (measured acceptance
    # and step cost; engine/spec/adaptive.py); False: always num_speculative_tokens
    adaptive: bool = True
    # how the draft picks its tokens: sampled from its processed distribution q
    # ("probabilistic"; verification uses q) or its argmax ("greedy", a point mass)
    draft_sample_method: str = "probabilistic"
    # "block" (the default): the drafted block at once (engine/spec/block_verify.py: the
    # target's distribution, never fewer accepted in expectation); "token": one draft at a time
    rejection_sample_method: str = "block"

    def __post_init__(self) -> None:
        if self.draft_sample_method not in ("probabilistic", "greedy"):
            raise ConfigError("draft_sample_method must be 'probabilistic' or 'greedy', got "
                              f"{self.draft_sample_method!r}")
        if self.rejection_sample_method not in ("token", "block"):
            raise ConfigError("rejection_sample_method must be 'token' or 'block', got "
                              f"{self.rejection_sample_method!r}")
        if self.method not in ("dspark", "ngram"):
            raise ConfigError(
                f"speculative method must be 'dspark' or 'ngram', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError("num_speculative_tokens must be in [1, 32], got "
                              f"{self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("need 1 <= ngram_min <= ngram_max")


MOE_BACKENDS = ("auto", "reference", "grouped", "ep_all2all", "tp_sharded")
EXECUTORS = ("uni", "mp", "torchrun", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """The process layout (docs/parallelism.md). Ranks = max(tensor, expert, data) parallel
    size x pipeline parallel size: tensor parallelism shards attention heads, MLPs and the
    vocabulary; expert parallelism partitions the routed experts over the same ranks
    (attention is then replicated when tensor_parallel_size is 1, or data parallel: each rank
    runs its own requests' attention, when data_parallel_size equals expert_parallel_size);
    pipeline parallelism splits the decoder layers into stages, one rank each.
    `distributed_executor`: "mp" (one spawned process per rank, also used for a single rank
    when asked for), "uni" (in-process; one rank only), "torchrun" (torchrun started the
    ranks; chosen by itself when WORLD_SIZE > 1 is in the environment) or "ray" (one Ray actor
    per rank, on the cluster at `ray_address`)."""

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # attention data parallel ("DEP"): each rank runs attention for its own requests, the
    # routed experts partitioned over the same ranks (expert_parallel_size == this)
    data_parallel_size: int = 1
    # pipeline parallel: the decoder layers split into this many stages, one rank each
    # (kdaserve/distributed/pipeline.py); only with the other sizes 1
    pipeline_parallel_size: int = 1
    moe_backend: str = "auto"
    distributed_executor: str | None = None    # None: torchrun's, else uni (1 rank) or mp
    worker_timeout_s: float = 300.0            # a collective that waits longer fails
    # "ray": the cluster to join (None: RAY_ADDRESS, else a local cluster started for us)
    ray_address: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp > 1 and ep > 1 and tp != ep:
            raise ConfigError(f"expert_parallel_size ({ep}) must be 1 or equal "
                              f"tensor_parallel_size ({tp}): experts are partitioned over the "
                              "tensor-parallel ranks")
        dp = self.data_parallel_size
        if dp > 1 and (tp != 1 or ep != dp):
            raise ConfigError(f"data_parallel_size {dp} is attention data parallel with "
                              f"expert-parallel MoE: it needs expert_parallel_size {dp} and "
                              f"tensor_parallel_size 1 (got {ep} and {tp})")
        pp = self.pipeline_parallel_size
        if pp > 1 and (tp, ep, dp) != (1, 1, 1):
            raise ConfigError(f"pipeline_parallel_size {pp} runs with tensor, expert and data "
                              f"parallel sizes 1 (got {tp}, {ep} and {dp}): combined layouts "
                              "are not built")
        if self.moe_backend not in MOE_BACKENDS:
            raise ConfigError(f"moe_backend must be one of {MOE_BACKENDS}, "
                              f"got {self.moe_backend!r}")
        if self.distributed_executor not in (None, *EXECUTORS):
            raise ConfigError(f"distributed_executor must be one of {EXECUTORS}, "
                              f"got {self.distributed_executor!r}")
        if self.distributed_executor == "uni" and self.world_size > 1:
            raise ConfigError("the in-process executor runs one rank; use 'mp' for "
                              f"{self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size,
                   self.data_parallel_size) * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        if self.distributed_executor:
            return self.distributed_executor
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:     # torchrun started us: its ranks
            return "torchrun"
        return "uni" if self.world_size == 1 else "mp"


ROLES = ("prefill", "decode")
KV_CONNECTORS = ("zmq", "nixl")      # kdaserve/disagg/zmq_connector.py, nixl_connector.py


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (kdaserve/disagg). A decode instance receives on
    `host:port`; a prefill instance only sends (to the peer each request names)."""

    role: str
    port: int | None = None
    host: str = "127.0.0.1"
    timeout_s: float = 10.0      # a send's wait for its acknowledgement; a receive's wait
    ttl_s: float = 60.0          # an arrived transfer nobody takes is dropped after this
    connector: str = "zmq"       # how the buffers travel (the control channel is ZeroMQ)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.connector not in KV_CONNECTORS:
            raise ConfigError(f"kv connector must be one of {KV_CONNECTORS}, got "
                              f"{self.connector!r}")
        if self.role == "decode" and self.port is None:
            raise ConfigError("--role decode needs --kv-transfer-port (where prefill "
                              "instances push caches to)")
        if self.timeout_s <= 0 or self.ttl_s <= 0:
            raise ConfigError("kv-transfer timeouts must be positive")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    kda_chunk_size: int | None = None
    seed: int = 0
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    enforce_eager: bool = False     # CUDA: no captured decode graphs
    async_scheduling: bool = False  # plan step N+1 while step N runs (engine/lookahead.py)
    # weight-only quantization on load: None, "int8" or "int4" (kdaserve/quant_config.py)
    quantization: str | None = None
    quantization_group_size: int = 128
    kv_transfer: KVTransferConfig | None = None   # a prefill or decode instance

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"quantization must be int8 or int4, got {self.quantization!r}")
        if self.quantization_group_size <= 0 or self.quantization_group_size % 2:
            raise ConfigError("quantization_group_size must be a positive even number, got "
                              f"{self.quantization_group_size}")
