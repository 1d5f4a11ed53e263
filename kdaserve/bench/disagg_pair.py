"""The prefill + decode pair `kdaserve bench disagg` drives: both engines stepping in turn in
this process (kdaserve/disagg/local.py), or the prefill engine in a process of its own pinned
to its CPUs (kdaserve/disagg/split_run.py). Either way a run returns the traces and what it
moved: the prefill side's transfer counters, and the decode side's under `decode_` (its
receive seconds and the prefix-hit tokens it did not write)."""

from __future__ import annotations

from typing import Any

from kdaserve.disagg.local import Trace, counters_since, run_disaggregated, transfer_counters
from kdaserve.disagg.split_run import PrefillProcess
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams


class Pair:
    def __init__(self, model: str, pre_args: dict[str, Any], dec_args: dict[str, Any],
                 prefill_cpus: set[int] | None = None) -> None:
        """`prefill_cpus`: run the prefill engine in its own process on them (the caller
        pinned this one to the decode side's CPUs before)."""
        self.dec = LLM(model, role="decode", kv_transfer_port=0, **dec_args)
        self.proc: PrefillProcess | None = None
        self.pre: LLM | None = None
        try:
            if prefill_cpus:
                self.proc = PrefillProcess(model, pre_args, self.dec.engine.transfer.address,
                                           prefill_cpus)
            else:
                self.pre = LLM(model, role="prefill", **pre_args)
        except BaseException:
            self.dec.engine.transfer.connector.close()
            raise

    def run(self, prompts: list[list[int]], params: SamplingParams, hit_query: bool = True
            ) -> tuple[list[Trace], dict[str, float]]:
        """All prompts at once (`hit_query` False: the whole prompt travels whatever the
        decode side holds)."""
        dec = self.dec.engine
        d0 = transfer_counters(dec)
        if self.proc is not None:
            traces, moved = self.proc.run(dec, prompts, params, hit_query)
        else:
            assert self.pre is not None
            before = transfer_counters(self.pre.engine)
            traces = run_disaggregated(self.pre.engine, dec, prompts, params,
                                       hit_query=hit_query)
            moved = counters_since(before, transfer_counters(self.pre.engine))
        moved.update({f"decode_{k}": v
                      for k, v in counters_since(d0, transfer_counters(dec)).items()})
        return traces, moved

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
        if self.pre is not None:
            self.pre.engine.transfer.connector.close()
        self.dec.engine.transfer.connector.close()
