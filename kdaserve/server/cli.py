"""`kdaserve serve`: the OpenAI-compatible HTTP server, with the engine in a child process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from kdaserve.assets import DEMO_MODEL_DIR, default_model_path
from kdaserve.config import (EXECUTORS, MOE_BACKENDS, CacheConfig, EngineConfig,
                             ParallelConfig, SchedulerConfig,
                             SpeculativeConfig)
from kdaserve.engine.async_engine import (
    DEFAULT_MAX_QUEUED_TOKENS,
    DEFAULT_MAX_WAITING,
    AsyncEngine,
    EngineStartupError,
)
from kdaserve.generation_defaults import generation_defaults
from kdaserve.model.registry import load_config
from kdaserve.request import SamplingParams
from kdaserve.server.app import DEFAULT_MAX_BODY_BYTES, build_app
from kdaserve.image_io import ImageLimits
from kdaserve.server.guards import ServerLimits
from kdaserve.vision_input import VisionInput
from kdaserve.server.lifecycle import DrainingServer
from kdaserve.server.reasoning import REASONING_FORMATS
from kdaserve.server.tool_parsers import TOOL_PARSERS
from kdaserve.tokenizer import Tokenizer

logger = logging.getLogger("kdaserve")

DEMO_MODEL_NAME = "kdaserve-demo"
API_KEY_ENV = "KDASERVE_API_KEY"
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
               "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
               "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "256MiB", "1GiB", "1.5G" (K/M/G/T are binary, KB/MB/... not)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or e.g. 256MiB, 1GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)
_port = _int_at_least(0, 65535)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--model", default=None, metavar="PATH",
                   help="model directory (config.json, *.safetensors, tokenizer files); "
                        "default: the bundled demo model")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000,
                   help="port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send and see in /v1/models (default: "
                        f"{DEMO_MODEL_NAME!r} for the bundled model, else the directory name)")
    p.add_argument("--max-model-len", type=_positive_int, default=4096,
                   help="longest prompt + completion in tokens (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64,
                   help="most requests in one batch; also the number of KDA state slots "
                        "(default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="token budget of one engine step (default: %(default)s)")
    p.add_argument("--cache-memory", type=parse_size, default="512MiB",
                   help="memory for MLA pages and KDA state slots, e.g. 256MiB, 1GiB or bytes "
                        "(default: 512MiB)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="on CUDA, size the cache as this fraction of the GPU's memory less what "
                        "is in use after loading the weights, e.g. 0.9 (--cache-memory is "
                        "used on CPU)")
    p.add_argument("--block-size", type=_positive_int, default=16,
                   help="tokens per MLA cache block, a power of two (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight and activation dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--kda-chunk-size", type=_positive_int, default=None,
                   help="KDA prefill chunk size (default: 64 on GPU, 16 on CPU)")
    p.add_argument("--max-waiting", type=_non_negative_int, default=DEFAULT_MAX_WAITING,
                   help="most sequences (n per prompt) waiting for their first token; beyond "
                        "it requests get HTTP 503 with Retry-After (default: %(default)s)")
    p.add_argument("--max-queued-tokens", type=_positive_int, default=DEFAULT_MAX_QUEUED_TOKENS,
                   help="most prompt tokens waiting for their first token (default: "
                        "%(default)s)")
    p.add_argument("--max-seqs-per-request", type=_positive_int, default=128,
                   help="most sequences (prompts x n) one request may ask for (default: "
                        "%(default)s)")
    p.add_argument("--default-max-tokens", type=_positive_int, default=1024,
                   help="max_tokens of chat requests that give none (default: %(default)s; "
                        "completions default to 16 as in OpenAI's API)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may run before it is aborted (HTTP 504 or an error "
                        "event); 0: no limit (default: %(default)s)")
    p.add_argument("--health-timeout", type=float, default=10.0,
                   help="/health turns 503 when the engine has not reported for this many "
                        "seconds (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running streams get to finish before they are "
                        "ended with an error event (default: %(default)s)")
    p.add_argument("--max-image-bytes", type=parse_size, default=ImageLimits.max_bytes,
                   help="largest encoded image accepted, e.g. 20MiB (default: %(default)s)")
    p.add_argument("--max-image-pixels", type=_positive_int, default=ImageLimits.max_pixels,
                   help="most pixels (width x height) of one image; larger ones, decompression "
                        "bombs included, are refused from their header (default: %(default)s)")
    p.add_argument("--max-images-per-request", type=_positive_int,
                   default=ImageLimits.max_images,
                   help="most images in one chat request (default: %(default)s)")
    p.add_argument("--allow-image-urls", default=None, metavar="HOST,...",
                   help="fetch http(s) image URLs from these hosts ('.example.com' matches "
                        "its subdomains); by default only inline data URLs are accepted")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set; "
                        "/health stays open)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --api-key, leave /metrics open too")
    p.add_argument("--max-body-size", type=parse_size, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; bigger ones get HTTP 413 (default: 16MiB)")
    p.add_argument("--seed", type=int, default=0, help="engine random seed (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off hybrid prefix caching (MLA blocks + KDA state snapshots)")
    p.add_argument("--state-snapshot-budget", type=_snapshot_budget, default=None,
                   help="memory for KDA state snapshots: bytes (e.g. 64MiB) or a fraction of "
                        "--cache-memory (e.g. 0.25, the default)")
    p.add_argument("--state-snapshot-interval", type=_positive_int, default=512,
                   help="also snapshot KDA states every N tokens of long prompts (default: "
                        "%(default)s)")
    p.add_argument("--offload", type=_offload_tiers, default=(),
                   help="keep evicted prefix-cache entries in host memory, on disk, or both "
                        "(host,disk: host in front of disk)")
    p.add_argument("--offload-bytes", type=_offload_sizes, default=(),
                   help="offload tier cap, e.g. 8GiB, or one per tier: 8GiB,50GiB (default: "
                        "4GiB host, 16GiB disk)")
    p.add_argument("--offload-dir", default=None,
                   help="directory of the disk tier; entries survive restarts with the same "
                        "model and cache layout")
    p.add_argument("--speculative-method", choices=("dspark", "ngram"), default=None,
                   help="speculative decoding: the DSpark draft fed by the target's hidden "
                        "states, or n-gram prompt lookup (default: off)")
    p.add_argument("--speculative-tokens", type=_positive_int, default=7,
                   help="drafts verified per step (default: %(default)s)")
    p.add_argument("--speculative-model", default=None,
                   help="DSpark draft directory (default: <model>/draft)")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="choose the drafts verified per request and step from measured "
                        "acceptance and step cost, speculation off where it does not pay "
                        "(default: on)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="ranks that shard attention heads, MLPs and the vocabulary, one "
                        "process each (docs/parallelism.md; default: %(default)s)")
    p.add_argument("--expert-parallel-size", type=_positive_int, default=1,
                   help="ranks the routed experts are partitioned over (1 or equal to "
                        "--tensor-parallel-size; default: %(default)s)")
    p.add_argument("--data-parallel-size", type=_positive_int, default=1,
                   help="attention data parallel with expert-parallel MoE (DEP): each rank "
                        "runs attention for its own requests; needs --expert-parallel-size "
                        "equal to it (default: %(default)s)")
    p.add_argument("--pipeline-parallel-size", type=_positive_int, default=1,
                   help="pipeline stages: the decoder layers split across this many ranks, "
                        "hidden states passed between them, several micro-batches in flight; "
                        "with the other parallel sizes 1 (default: %(default)s)")
    p.add_argument("--moe-backend", choices=MOE_BACKENDS, default="auto",
                   help="how routed experts run; auto picks by topology and logs why "
                        "(default: %(default)s)")
    p.add_argument("--distributed-executor", choices=EXECUTORS, default=None,
                   help="in-process (one rank), one spawned process per rank (mp), the ranks "
                        "torchrun started, or one Ray actor per rank (ray) (default: torchrun's "
                        "ranks under torchrun, else uni for one rank, else mp)")
    p.add_argument("--ray-address", default=None,
                   help="with --distributed-executor ray: the cluster to join, e.g. "
                        "10.0.0.1:6379 (default: $RAY_ADDRESS, else a local cluster)")
    p.add_argument("--torch-threads", type=_positive_int, default=None,
                   help="torch intra-op threads of the engine process (default: torch's)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="read tool calls in this model format (tool_choice auto); "
                        "required/named tool_choice work without one (default: none)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_FORMATS), default=None,
                   help="move thinking text to reasoning_content (default: none)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="log level (default: %(default)s)")


def load_generation_defaults(model_dir: Path) -> dict[str, Any]:
    """generation_config.json sampling defaults, checked now rather than on every request."""
    defaults = generation_defaults(model_dir)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{model_dir / 'generation_config.json'}: {exc}") from None
    return defaults


def served_model_name(model_dir: Path, override: str | None = None) -> str:
    if override:
        return override
    if model_dir.resolve() == DEMO_MODEL_DIR.resolve():
        return DEMO_MODEL_NAME
    return model_dir.resolve().name


def _snapshot_budget(text: str) -> float | int:
    try:
        frac = float(text)
    except ValueError:
        return parse_size(text)
    if 0 <= frac < 1:
        return frac
    return parse_size(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _offload_tiers(text: str) -> tuple[str, ...]:
    tiers = tuple(t.strip() for t in text.split(",") if t.strip())
    if tiers not in (("host",), ("disk",), ("host", "disk")):
        raise argparse.ArgumentTypeError(f"use host, disk or host,disk, got {text!r}")
    return tiers


def _offload_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(","))


def _engine_config(args: argparse.Namespace, model_dir: Path) -> EngineConfig:
    budget = getattr(args, "state_snapshot_budget", None)
    if isinstance(budget, float):
        budget = int(budget * args.cache_memory)
    return EngineConfig(
        model=str(model_dir), dtype=args.dtype, device=args.device,
        kda_chunk_size=args.kda_chunk_size, seed=args.seed,
        num_threads=getattr(args, "torch_threads", None),
        cache=CacheConfig(block_size=args.block_size, cache_memory_bytes=args.cache_memory,
                          gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                          enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
                          state_snapshot_budget_bytes=budget,
                          state_snapshot_interval=getattr(args, "state_snapshot_interval", 512),
                          offload_tiers=getattr(args, "offload", ()),
                          offload_bytes=getattr(args, "offload_bytes", ()),
                          offload_dir=getattr(args, "offload_dir", None)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len),
        speculative=SpeculativeConfig(method=args.speculative_method,
                                      num_speculative_tokens=args.speculative_tokens,
                                      draft_model=args.speculative_model,
                                      adaptive=getattr(args, "speculative_adaptive", True))
        if getattr(args, "speculative_method", None) else None,
        parallel=ParallelConfig(
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            expert_parallel_size=getattr(args, "expert_parallel_size", 1),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
            moe_backend=getattr(args, "moe_backend", "auto"),
            distributed_executor=getattr(args, "distributed_executor", None),
            ray_address=getattr(args, "ray_address", None)),
    )


@contextlib.contextmanager
def _exit_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


async def _serve(args: argparse.Namespace, config: EngineConfig, tokenizer: Tokenizer,
                 defaults: dict[str, Any], name: str) -> int:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    server: DrainingServer | None = None

    def on_dead(why: str) -> None:
        if server is not None:
            server.engine_died(why)

    engine = AsyncEngine(config, max_waiting=args.max_waiting,
                         max_queued_tokens=args.max_queued_tokens,
                         log_level=getattr(logging, args.log_level.upper()), on_dead=on_dead)
    try:
        # While the model loads, SIGINT/SIGTERM cancel us (and so stop the engine).
        with _exit_signals(lambda *_: loop.call_soon_threadsafe(main.cancel)):
            try:
                info = await engine.start()
            except EngineStartupError as exc:
                logger.error("the engine failed to start: %s", exc)
                return 1
        logger.info("cache plan: %s", info.plan)
        limits = ServerLimits(
            max_seqs_per_request=args.max_seqs_per_request,
            default_max_tokens=args.default_max_tokens,
            request_timeout_s=args.request_timeout or None,
            health_timeout_s=args.health_timeout, shutdown_timeout_s=args.shutdown_timeout,
            max_token_bytes=tokenizer.max_token_bytes())
        hosts = tuple(h.strip() for h in (args.allow_image_urls or "").split(",") if h.strip())
        image_limits = ImageLimits(
            max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels,
            max_images=args.max_images_per_request, allow_remote=bool(hosts),
            allowed_hosts=hosts)
        vision = VisionInput.for_model(config.model, tokenizer)
        if vision is not None:
            logger.info("vision: images accepted (placeholder %r, %d pixel patches)",
                        vision.placeholder, vision.processor.patch_size)
        app = build_app(engine, tokenizer, name, info.max_model_len, api_key=args.api_key,
                        max_body_bytes=args.max_body_size, generation_defaults=defaults,
                        limits=limits, public_metrics=args.public_metrics,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, vision=vision,
                        image_limits=image_limits)
        server = DrainingServer(uvicorn.Config(
            app, host=args.host, port=args.port, log_config=None, lifespan="off",
            log_level=args.log_level, timeout_graceful_shutdown=5),
            app.state.serving, args.shutdown_timeout)
        logger.info("serving %r on http://%s:%d/v1", name, args.host, args.port)
        # uvicorn handles the signals while serving and re-raises them once it has stopped; the
        # no-op handler lets the engine shut down cleanly after that.
        with _exit_signals(lambda *_: None):
            try:
                await server.serve()
            except SystemExit as exc:        # uvicorn exits like this when it cannot bind
                return exc.code if isinstance(exc.code, int) and exc.code else 1
        if engine.died:
            return 1
        return server.exit_code if server.started else 1
    except asyncio.CancelledError:
        logger.info("interrupted")
        return 130
    finally:
        with _exit_signals(lambda *_: None):
            await engine.shutdown()


def run_serve(args: argparse.Namespace) -> int:
    from kdaserve.engine.executor.torchrun import is_torchrun_worker, run_torchrun_rank

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)       # also when the caller configured logging first
    try:
        model_dir = Path(args.model) if args.model else default_model_path()
        load_config(model_dir)        # fail fast on a bad path or config
        tokenizer = Tokenizer.from_pretrained(model_dir)
        defaults = load_generation_defaults(model_dir)
        config = _engine_config(args, model_dir)
        worker = is_torchrun_worker(config.parallel)
    except (OSError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    if worker:                       # a torchrun rank > 0: the worker loop, no server
        return run_torchrun_rank(config)
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    name = served_model_name(model_dir, args.served_model_name)
    return asyncio.run(_serve(args, config, tokenizer, defaults, name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdaserve serve",
                                     description="OpenAI-compatible server for kdaserve models")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
