"""Decode steps replayed from captured CUDA graphs, one per padded batch size.

A decode step of n one-token rows is padded to the next captured size (1, 2, 4, ... up to
--max-num-seqs) and replayed: the graph reads the step's inputs from the persistent buffers
(engine/decode_inputs.py) and recomputes, on the device, what the layout derives from them
(model/layout/mla.py `refresh_decode`), so one capture serves every step of that size. Padding
rows read and write a KDA slot and an MLA block reserved for them (never handed to a request),
so they cannot touch a real request's cache. Snapshots that a decode row takes at a block
boundary are its final state, copied from its slot after the replay (HybridCache.save_slots).

Two backends: CUDA graphs, and on CPU a replay that calls the recorded step again (the tests run
the whole mechanism, padding and buffers and refresh, without a GPU). `--enforce-eager` turns
graphs off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kdaserve.engine.decode_inputs import DecodeInputs, DecodeStepInputs
from kdaserve.model.base import HybridForCausalLM
from kdaserve.model.batch import ForwardBatch, build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.layout.mla import refresh_decode
from kdaserve.ops import mla as mla_ops
from kdaserve.outputs import ScheduledSequence

logger = logging.getLogger("kdaserve")


def graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds max_num_seqs."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes


@dataclass
class CapturedStep:
    """One padded batch size: its layout over the persistent buffers and its static outputs."""

    size: int
    inputs: DecodeStepInputs
    fb: ForwardBatch
    replay: Callable[[], None]
    logits: torch.Tensor                 # [size, vocab], rewritten by each replay
    captured: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class CaptureReport:
    sizes: list[int]
    seconds: float
    bytes: int                           # device memory the graphs hold (0 on CPU)
    skipped: list[int]                   # sizes whose layout is not graph-safe here


class DecodeGraphs:
    def __init__(self, model: HybridForCausalLM, cache: HybridCache, inputs: DecodeInputs,
                 pad_slot: int, pad_block: int, capture_layers: tuple[int, ...] = (),
                 backend: str = "cuda") -> None:
        """backend: "cuda" (torch.cuda.CUDAGraph) or "replay" (call the step again: CPU)."""
        self.model, self.cache, self.inputs = model, cache, inputs
        self.pad_slot, self.pad_block = pad_slot, pad_block
        self.capture_layers = capture_layers
        self.backend = backend
        self.steps: dict[int, CapturedStep] = {}
        self.report: CaptureReport | None = None
        self._pool = None

    def capture(self, sizes: list[int]) -> CaptureReport:
        t0 = time.perf_counter()
        dev = self.inputs.device
        before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        skipped = []
        for n in sorted(sizes, reverse=True):     # the largest first: smaller ones reuse its pool
            if not self._graph_safe(n):
                skipped.append(n)
                continue
            self.steps[n] = self._capture_one(n)
        after = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        self.report = CaptureReport(sorted(self.steps), time.perf_counter() - t0,
                                    after - before, sorted(skipped))
        return self.report

    def _graph_safe(self, n: int) -> bool:
        """Past the dense decode size the torch split-K reads lengths back to the host; a
        device kernel for it (kdaserve/ops/gpu) is graph-safe."""
        keys = n * self.inputs.width * self.cache.block_size
        return keys <= mla_ops.DENSE_MAX_DECODE_KEYS or mla_ops.decode_split_k_graph_safe(
            self.inputs.device)

    def size_for(self, n: int) -> int | None:
        """The captured size a step of n rows is padded to (None: none holds it)."""
        return min((s for s in self.steps if s >= n), default=None)

    def fill(self, seqs: list[ScheduledSequence], size: int) -> None:
        self.inputs.fill(seqs, pad_to=size, pad_slot=self.pad_slot, pad_block=self.pad_block)

    def replay(self, size: int) -> CapturedStep:
        step = self.steps[size]
        step.replay()
        return step

    def _capture_one(self, n: int) -> CapturedStep:
        inp = self.inputs.fill([], pad_to=n, pad_slot=self.pad_slot, pad_block=self.pad_block)
        cfg = self.model.config
        fb = build_forward_batch(
            [1] * n, [1] * n, num_decode=n, conv_kernel=cfg.conv_kernel_size,
            chunk_size=self.model.chunk_size, cache=self.cache, block_tables=inp.block_table,
            state_slots=inp.slots, logits_indices=list(range(n)), device=self.inputs.device,
            positions=inp.positions, sync_free=True, decode_width=self.inputs.width)
        bs = self.cache.block_size

        def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
            refresh_decode(fb.mla, inp.positions, inp.block_table, bs)
            return self.model(inp.ids, fb, capture_layers=self.capture_layers)

        if self.backend == "replay":
            logits, captured = step()
            out = CapturedStep(n, inp, fb, lambda: None, logits, captured)

            def replay() -> None:
                out.logits, out.captured = step()
            out.replay = replay
            return out
        stream = torch.cuda.Stream(self.inputs.device)
        stream.wait_stream(torch.cuda.current_stream(self.inputs.device))
        with torch.cuda.stream(stream):            # warm up kernels and autotuners outside
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.inputs.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, captured = step()
        if self._pool is None:
            self._pool = graph.pool()
        return CapturedStep(n, inp, fb, graph.replay, logits, captured)


def decode_graphs_log(report: CaptureReport) -> None:
    logger.info("kdaserve decode graphs: batch sizes %s captured in %.2f s, %.1f MiB%s",
                report.sizes, report.seconds, report.bytes / 2**20,
                f" (not graph-safe here: {report.skipped})" if report.skipped else "")
