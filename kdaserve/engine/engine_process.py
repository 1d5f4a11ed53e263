"""The engine process: an `EngineCore` driven by commands from the server over ZeroMQ.

It blocks on its command socket while it has no work and otherwise alternates between draining
commands and running one engine step, sending each step's deltas as one message. Torch is
imported here only, never in the server process.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

import msgspec
import zmq

from kdaserve.config import EngineConfig
from kdaserve.engine.cpu_share import CpuShare
from kdaserve.engine.grammar_admission import GrammarAdmission
from kdaserve.engine.wire import (AbortCmd, AddCmd, AddFailed, Command, DeltaBatch, EngineInfo,
                                  EngineStatsSnapshot, Fatal, Heartbeat, HoldCmd, HoldReply,
                                  Reply, ShutdownCmd, StartupFailed, StatsCmd, StatsReply)
from kdaserve.request import SamplingParams

logger = logging.getLogger("kdaserve")

_IDLE_POLL_MS = 250           # how often an idle child checks that its parent is still there
_COMPILE_POLL_MS = 5          # how often it checks for compiled grammars (nothing else to do)
HEARTBEAT_S = 0.5             # the child reports at least this often while it is healthy


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---- the child process -----------------------------------------------------------------------
def engine_process_main(config_msg: bytes, cmd_addr: str, out_addr: str, log_level: int) -> None:
    """Entry point of the engine process (spawned, so it starts from a fresh interpreter)."""
    # Ctrl-C or a SIGTERM to the process group reaches the server too, which then shuts us down
    # once its open requests are done; if the server dies instead, the loop notices and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    ctx = zmq.Context()
    cmds = ctx.socket(zmq.PULL)
    cmds.setsockopt(zmq.RCVHWM, 0)
    cmds.connect(cmd_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        try:
            from kdaserve.engine.core import EngineCore  # torch is imported here, in the child

            core = EngineCore(msgspec.msgpack.decode(config_msg, type=EngineConfig))
        except Exception as exc:
            logger.error("engine failed to start: %s", _describe(exc))
            out.send(encoder.encode(StartupFailed(_describe(exc))))
            raise SystemExit(1) from None
        plan = core.plan
        out.send(encoder.encode(EngineInfo(
            max_model_len=core.max_model_len, vocab_size=core.model_config.vocab_size,
            plan=plan.describe(), num_blocks=plan.num_blocks, block_size=plan.block_size,
            num_state_slots=plan.num_state_slots)))
        try:
            EngineLoop(core, cmds, out, encoder).run()
        except Exception as exc:
            logger.error("engine loop failed:\n%s", traceback.format_exc())
            out.send(encoder.encode(Fatal(_describe(exc))))
            # the workers of a parallel layout too: they ignore SIGTERM as we do (inherited), so
            # multiprocessing's exit would wait on them until the server killed us
            core.executor.shutdown()
            raise SystemExit(1) from None
        try:      # a clean shutdown: the device cache goes to the offload tiers (disk persists)
            core.close()
        except Exception:
            logger.exception("flushing the cache to the offload tiers at shutdown failed")
        finally:
            core.shutdown()          # worker processes of a parallel layout
    finally:
        cmds.close(linger=0)
        out.close(linger=5000)     # deliver the last message even if we exit right after
        ctx.term()


class EngineLoop:
    def __init__(self, core: Any, cmds: zmq.Socket, out: zmq.Socket,
                 encoder: msgspec.msgpack.Encoder) -> None:
        self.core = core
        self.cmds = cmds
        self.out = out
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(Command)
        self.parent = os.getppid()
        self._last_sent = 0.0
        # requests whose grammar compiles off this loop (grammar_admission.py)
        self.grammars: GrammarAdmission[tuple[AddCmd, SamplingParams]] = GrammarAdmission(
            core.executor.validate_guided)
        # the forward's threads follow the cores other processes leave (cpu_share.py)
        runner = getattr(core.executor, "runner", None)
        self.share = (CpuShare(runner.threads)
                      if runner is not None and runner.device.type == "cpu" else None)

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.grammars.close()

    def _run(self) -> None:
        while True:
            if os.getppid() != self.parent:
                logger.warning("the server process is gone; the engine exits")
                return
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self.core.executor.check_alive()     # a dead rank: no more heartbeats
                self._send(Heartbeat())
                self.core.expire_holds()             # an idle decode instance's too
            poll_ms = _COMPILE_POLL_MS if self.grammars.busy else _IDLE_POLL_MS
            if not self.core.has_unfinished() and not self.cmds.poll(poll_ms):
                self._admit_compiled()
                continue
            if not self._drain():
                return
            self._admit_compiled()
            if self.core.has_unfinished():
                if self.share is not None:
                    self.core.runner.set_threads(self.share.threads())
                deltas = self.core.step()
                if deltas:
                    self._send(DeltaBatch(deltas))

    def _send(self, msg: Reply) -> None:
        self.out.send(self.encoder.encode(msg))
        self._last_sent = time.monotonic()

    def _drain(self) -> bool:
        """Handle every queued command; False once told to shut down."""
        while True:
            try:
                frame = self.cmds.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                cmd = self.decoder.decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropping an undecodable command: %s", exc)
                continue
            if isinstance(cmd, ShutdownCmd):
                return False
            self._handle(cmd)

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AddCmd):
            self._add(cmd)
        elif isinstance(cmd, AbortCmd):
            for rid in cmd.request_ids:
                if not self.grammars.discard(rid):
                    self.core.abort(rid)
        elif isinstance(cmd, StatsCmd):
            self._send(StatsReply(cmd.token, self._stats()))
        elif isinstance(cmd, HoldCmd):
            try:
                held = self.core.hold_prefix(cmd.transfer_id, cmd.prompt_token_ids)
            except ValueError as exc:
                self._send(HoldReply(cmd.token, 0, str(exc)))
            else:
                self._send(HoldReply(cmd.token, held))

    def _add(self, cmd: AddCmd) -> None:
        try:
            params = msgspec.msgpack.decode(cmd.params, type=SamplingParams)
        except ValueError as exc:   # SamplingParamsError and msgspec.ValidationError included
            self._send(AddFailed(cmd.request_id, str(exc), invalid_input=True))
            return
        if params.guided is not None:   # compiled off this loop first (a cache hit: at once)
            self.grammars.submit(cmd.request_id, params.guided, (cmd, params))
        else:
            self._add_now(cmd, params)

    def _admit_compiled(self) -> None:
        for c in self.grammars.done():
            cmd, params = c.item
            if c.error is None:
                self._add_now(cmd, params)
            elif isinstance(c.error, ValueError):       # GuidedDecodingError: a 400
                self._send(AddFailed(cmd.request_id, str(c.error), invalid_input=True))
            else:
                logger.error("compiling the grammar of %s failed: %s", cmd.request_id,
                             _describe(c.error))
                self._send(AddFailed(cmd.request_id, _describe(c.error), invalid_input=False))

    def _add_now(self, cmd: AddCmd, params: SamplingParams) -> None:
        try:
            self.core.add_request(cmd.request_id, cmd.prompt_token_ids, params,
                                  priority=cmd.priority, group=cmd.group,
                                  media=[m.item() for m in cmd.media],
                                  stream_text=cmd.stream_text)
        except ValueError as exc:   # SamplingParamsError and msgspec.ValidationError included
            self._send(AddFailed(cmd.request_id, str(exc), invalid_input=True))
        except Exception as exc:
            logger.exception("add_request(%s) failed", cmd.request_id)
            self._send(AddFailed(cmd.request_id, _describe(exc), invalid_input=False))

    def _stats(self) -> EngineStatsSnapshot:
        from kdaserve.engine.tier_transfer import offload_stats   # torch: in the engine process

        core, cache = self.core, self.core.cache
        cs = cache.stats
        return EngineStatsSnapshot(
            num_running=core.num_running, num_waiting=core.num_waiting,
            cache_usage=float(cache.usage), num_free_blocks=cache.num_free_blocks,
            num_free_slots=cache.num_free_slots, num_blocks=cache.block_pool.num_blocks,
            all_free=bool(cache.all_free()), prefix_cache_queries=cs.queries,
            prefix_cache_hits=cs.hits, prefix_cache_query_tokens=cs.query_tokens,
            prefix_cache_hit_tokens=cs.hit_tokens, state_snapshots=cache.snapshots.num_used,
            state_snapshot_bytes=cache.snapshots.bytes_held, prompt_tokens=core.stats.prompt_tokens,
            generation_tokens=core.stats.generation_tokens,
            preemptions=core.stats.preemptions, steps=core.stats.steps,
            spec_verifications=core.scheduler.num_verify_rows,
            spec_draft_tokens=core.scheduler.num_draft_tokens,
            spec_accepted_tokens=core.scheduler.num_accepted_tokens,
            spec_acceptance_lengths=dict(core.scheduler.acceptance_lengths),
            spec_accepted_by_position=dict(core.scheduler.accepted_by_position),
            spec_draft_seconds=core.stats.spec_draft_seconds,
            spec_verify_seconds=core.stats.spec_verify_seconds,
            spec_dormant_seconds=core.stats.spec_dormant_seconds,
            spec_adaptive=(core.scheduler.spec_policy.decisions()
                           if core.scheduler.spec_policy is not None else {}),
            offload=(offload_stats(cache.offload, core.executor.transfer_stats())
                     if cache.offload is not None else {}),
            kv_transfer=core.transfer.metrics() if core.transfer is not None else {})
