"""The step loop: schedule -> run the model -> update requests -> detokenize and stop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kdaserve.cache.manager import CacheManager
from kdaserve.cache.ops import TakeSnapshot
from kdaserve.cache.planner import CachePlan
from kdaserve.config import EngineConfig
from kdaserve.engine import request_intake, step_accounting
from kdaserve.engine.async_steps import StepPipeline
from kdaserve.engine.core_setup import engine_cache_plan, load_engine_model
from kdaserve.engine.executor import Executor, ExecutorError
from kdaserve.engine.executor.uniproc import UniProcExecutor
from kdaserve.engine.lookahead import settle_results
from kdaserve.engine.offload_setup import open_tiers
from kdaserve.engine.request_tracking import RequestTracker
from kdaserve.engine.runner import ModelRunner
from kdaserve.engine.runner_builder import (
    build_runner,
    engine_chunk_size,
    has_tokenizer,
)
from kdaserve.engine.scheduler import Scheduler
from kdaserve.engine.spec.adaptive import AdaptiveSpeculation
from kdaserve.engine.step_message import StepMessages
from kdaserve.media import MediaItem
from kdaserve.model.base import HybridForCausalLM
from kdaserve.ops.cpu_isa import cpu_isa
from kdaserve.ops.cpu_isa import requested as requested_isa
from kdaserve.ops.host_memory import freeze_startup_heap, tune_host_allocator
from kdaserve.outputs import RequestDelta, SchedulerOutput
from kdaserve.request import RequestStatus, SamplingParams
from kdaserve.tokenizer import Tokenizer

logger = logging.getLogger("kdaserve")


@dataclass
class EngineStats:
    steps: int = 0
    failed: int = 0              # requests ended by an error in an engine step
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    # speculation: seconds in the proposer, in steps that verified drafts (less the proposer's
    # share), and in steps run while the drafter slept (adaptive speculation)
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0
    spec_dormant_seconds: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, model: HybridForCausalLM | None = None,
                 tokenizer: Tokenizer | None = None, progress: bool = False) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        if device.type == "cpu":
            tune_host_allocator()
            logger.info("kdaserve CPU kernels: built for %s (KDASERVE_CPU_ISA=%s)", cpu_isa(),
                        requested_isa())
        chunk = engine_chunk_size(config)
        par = config.parallel
        if config.kv_transfer is not None:       # refused before any rank starts
            from kdaserve.disagg.setup import check_role_layout

            check_role_layout(config)
        em = load_engine_model(config, device, model, progress)
        self.model: HybridForCausalLM | None = em.model     # None: the workers hold the model
        model, cfg, rank_cfg, self._vision = em.model, em.config, em.rank_config, em.vision
        self.model_config = cfg
        if tokenizer is None and config.model and has_tokenizer(Path(config.model)):
            tokenizer = Tokenizer.from_pretrained(config.model)
        self.tokenizer = tokenizer
        self.plan: CachePlan
        self.plan, sched = engine_cache_plan(config, em, device)
        cc = config.cache
        self.max_model_len = sched.max_model_len
        tiers = open_tiers(config, rank_cfg, chunk, device)
        self.cache = CacheManager.from_plan(self.plan, cc,
                                            offload=tiers.offload if tiers else None)
        self.scheduler = Scheduler(sched, self.cache)
        spec = config.speculative
        if spec is not None and spec.adaptive:
            self.scheduler.spec_policy = AdaptiveSpeculation(spec.num_speculative_tokens)
        if par.executor == "uni":
            self.executor: Executor = UniProcExecutor(build_runner(
                config, self.plan, model, device, tokenizer,
                stores=tiers.stores if tiers else None))
        else:
            from kdaserve.engine.executor import start_ranks
            from kdaserve.structured.manager import StructuredOutputs

            # grammars are validated here, compiled again on each rank
            self.executor = start_ranks(config, self.plan,
                                        StructuredOutputs(tokenizer, cfg.vocab_size))
        self._messages = StepMessages()
        # told each step's plan before it runs (`kdaserve plan --calibrate` times steps by
        # their shape); synchronous steps only
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None
        self._pipeline: StepPipeline | None = None
        self.transfer = None          # disaggregation's connector side (kdaserve/disagg)
        if config.kv_transfer is not None and par.executor == "uni":
            from kdaserve.disagg.setup import attach_transfer

            self.transfer = attach_transfer(config, rank_cfg, self.runner)
        elif config.kv_transfer is not None:     # each rank attached its own (worker.py)
            from kdaserve.disagg.setup import RankTransfers

            self.transfer = RankTransfers(self.executor, config.speculative is not None)
        if config.async_scheduling and config.kv_transfer is not None:
            logger.warning("async scheduling is off on a prefill or decode instance (a "
                           "finished request's cache is sent between steps)")
        elif config.async_scheduling:
            if par.executor != "uni" or config.speculative is not None:
                logger.warning("async scheduling needs the in-process executor and no "
                               "speculative decoding; steps run synchronously")
            else:
                self._pipeline = StepPipeline(self)
        if (par.executor == "uni" and self._pipeline is None and config.kv_transfer is None
                and (spec is None or self.scheduler.spec_policy is not None)):
            # engine/decode_burst.py says why (adaptive speculation: while its drafter sleeps)
            self.scheduler.max_burst = sched.num_scheduler_steps
        self.eos_ids = frozenset(tokenizer.eos_token_ids if tokenizer else cfg.eos_token_id)
        self.stats = EngineStats()
        self.tracker = RequestTracker(self.scheduler, self.stats)
        logger.info("kdaserve cache: %s", self.plan.describe())
        freeze_startup_heap()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    extra_keys: tuple = (), group: str | None = None,
                    media: Sequence[MediaItem] = (), stream_text: bool = True) -> None:
        """`group` is the fairness unit (default: this request with its n completions).
        media: the prompt's images (their placeholder runs already expanded in the ids).
        stream_text=False: the caller reads the text only once the request ends (the deltas
        before the last carry none; ids and logprobs still come each step)."""
        request_intake.add_request(self, request_id, prompt_token_ids, params, priority,
                                   arrival_time, cache_salt, extra_keys, group, media,
                                   stream_text)

    def hold_prefix(self, transfer_id: str, prompt_token_ids: list[int]) -> int:
        """Disaggregation's hit query on a decode instance: how many leading tokens of this
        prompt its prefix cache holds. They are pinned under `transfer_id` until the import of
        that id takes them, or --kv-transfer-ttl passes (kdaserve/cache/holds.py)."""
        kt = self.config.kv_transfer
        if kt is None or kt.role != "decode":
            raise ValueError("the hit query (kv_transfer_params.hold) needs a decode instance "
                             "(serve --role decode)")
        self.expire_holds()
        return self.cache.hold(transfer_id, list(prompt_token_ids), (), None,
                               time.monotonic() + kt.ttl_s)

    def expire_holds(self) -> None:
        """Holds whose import never came give their blocks back."""
        if len(self.cache.prefix_holds):
            self.cache.prefix_holds.expire(time.monotonic())

    @property
    def vision_config(self):
        """The vision tower's config (every rank holds the tower whole), None without one."""
        return self._vision

    def abort(self, request_id: str) -> None:
        self.tracker.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (
            self._pipeline is not None and self._pipeline.busy)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- offload tiers -----------------------------------------------------------------------
    def flush_cache(self, drop_device: bool = False) -> None:
        """Copy the device prefix cache into the offload tiers now (see CacheManager.flush)."""
        self._drain()                  # the runner's tensors are the runner thread's meanwhile
        ops = self.cache.flush(drop_device)
        if ops:
            self.cache.settle(self.executor.run_cache_ops(ops).failures)
            self.executor.run_cache_ops(self.cache.take_ops())   # drops of failed entries

    def close(self) -> None:
        """Before the engine goes away: what the device cache holds goes to the offload tiers,
        so a restarted engine finds it in the disk tier."""
        self.flush_cache()

    def shutdown(self) -> None:
        """Stop the worker processes, if any (the engine is unusable afterwards)."""
        self._drain()
        self.executor.shutdown()

    def _drain(self) -> list[RequestDelta]:
        """Wait for a step in flight (async scheduling) and take in its result."""
        return self._pipeline.drain() if self._pipeline is not None else []

    @property
    def runner(self) -> ModelRunner:
        """The in-process runner (the uni-process executor's)."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError("the model runners live in worker processes")
        return runner

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One engine step. A failure inside it is isolated to its request: the step's requests
        are reset (their caches freed, to be recomputed) and then run alone, one per step, so
        the next failure names the one request that causes it; that request ends with an error
        and the others go on. A failure the scheduler itself raises is an engine bug (fatal)."""
        if self._pipeline is not None:
            return self._pipeline.step()
        self.expire_holds()
        out = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(out)
        try:
            deltas = self._run(out)
        except ExecutorError:
            raise                      # a worker is gone: fatal, not one request's failure
        except Exception as exc:
            return self._on_step_failure(out, exc)
        if len(out.sequences) == 1:
            self.scheduler.cleared(out.sequences[0].request_id)
        return deltas

    def _on_step_failure(self, out, exc: Exception) -> list[RequestDelta]:
        # snapshots planned for the failed step may never have been written: never let a hit
        # (or an offload tier) take them
        self.cache.drop_snapshots([op.snapshot_id for op in out.ops_of(TakeSnapshot)])
        ids = [s.request_id for s in out.sequences if s.request_id in self.scheduler.requests]
        if not ids:
            raise exc
        if len(ids) == 1:
            rid = ids[0]
            logger.error("request %s failed in an engine step; it ends with an error",
                         self.tracker.parent(rid), exc_info=exc)
            self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            return [self.tracker.failed(rid, f"{type(exc).__name__}: {exc}")]
        logger.warning("an engine step failed (%s: %s); retrying its %d requests one at a "
                       "time", type(exc).__name__, exc, len(ids))
        for rid in ids:
            self.scheduler.reset_for_retry(rid)
            self._messages.forget(rid)   # the runner hears it whole again (its copy may differ)
        return []

    def _run(self, out) -> list[RequestDelta]:
        start = time.perf_counter()
        result = self.executor.execute(self._messages.attach(out, self.scheduler.requests))
        return self._finish(out, result, time.perf_counter() - start)

    def _finish(self, out, result, seconds: float, dispatched: bool = False
                ) -> list[RequestDelta]:
        """A step's result into the requests and their deltas. `dispatched`: async scheduling
        advanced the step's counts when it started (engine/lookahead.py)."""
        step_accounting.observe(self, out, result, seconds)
        touched = (settle_results(self.scheduler, out, result) if dispatched
                   else self.scheduler.update(out, result))
        return self.tracker.deltas(touched, self._send_caches(), result.grammar_errors)

    def _send_caches(self) -> dict[str, str]:
        """Push the caches of requests that just ended on a prefill instance, before the next
        step reuses their blocks; returns those that failed, with why (the request then
        ends with that error, and its client's proxy retries or reports it)."""
        sends = self.scheduler.take_sends()
        if not sends:
            return {}
        outcome = self.executor.run_cache_ops(sends)
        return {f.request_id: f.reason for f in outcome.failures if f.request_id is not None}
