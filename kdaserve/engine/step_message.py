"""The step message's request data: what a runner knows of each request, kept in step with the
scheduler's `Request` objects without ever reading them from the runner's side.

Rank 0 (`StepMessages.attach`) adds to each `SchedulerOutput` the requests its runner(s) have
not seen yet (prompt, sampling params, output so far) and, for the others, only the output
tokens appended since the runner last heard: a step carries O(new tokens), not O(context), so
it can cross a process boundary cheaply. The runner side (`RunnerRequests`) applies them and
offers each request under the attribute names the sampler, the proposers and the grammar
masks read (`request_id`, `prompt_token_ids`, `output_token_ids`, `sampling_params`,
`all_token_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kdaserve.outputs import RequestData, SchedulerOutput
from kdaserve.request import PENDING, Request, SamplingParams


class StepMessages:
    """Rank 0's record of what the runner(s) hold: request id -> output tokens sent."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def attach(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> SchedulerOutput:
        for rid in out.finished:
            self._sent.pop(rid, None)
        data: dict[str, RequestData] = {}
        for s in out.sequences:
            req = requests.get(s.request_id)
            if req is None:
                continue
            outs = req.output_token_ids
            sent = self._sent.get(s.request_id)
            if sent is None:
                data[s.request_id] = RequestData(0, list(outs), list(req.prompt_token_ids),
                                                 req.sampling_params)
            elif sent != len(outs):
                start = min(sent, len(outs))
                data[s.request_id] = RequestData(start, list(outs[start:]))
            self._sent[s.request_id] = len(outs)
        out.request_data = data
        return out

    def forget(self, request_id: str) -> None:
        """The runner will be told again from scratch (e.g. after a failed step)."""
        self._sent.pop(request_id, None)

    def reset(self) -> None:
        self._sent.clear()


@dataclass
class RunnerRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # its token is the argmax of its logits row: greedy, no penalty, bias, grammar or logprobs
    # (the sampler's shortcut for such rows, row_sampling.py)
    argmax_only: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.sampling_params
        self.argmax_only = (p.temperature == 0 and not p.penalised and not p.logit_bias
                            and p.logprobs is None and p.guided is None)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RunnerRequests(dict[str, RunnerRequest]):
    """The runner's copy of the requests it runs, updated from each step's request data."""

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished:
            self.pop(rid, None)
        for rid, d in out.request_data.items():
            if d.prompt_token_ids is not None:
                self[rid] = RunnerRequest(rid, d.prompt_token_ids, d.params,
                                          list(d.output_token_ids))
                continue
            req = self.get(rid)
            if req is None:
                raise KeyError(f"step message updates request {rid!r} the runner never saw")
            merge_outputs(req.output_token_ids, d.output_start, d.output_token_ids)


def merge_outputs(outs: list[int], start: int, tail: list[int]) -> None:
    """The engine's outputs from `start` on, into the runner's copy. The runner appends what it
    samples itself, so its copy may run ahead of the engine's: the tail overwrites, never
    truncates, and a PENDING token (sampled by a step still in flight when the message was
    made: engine/lookahead.py) keeps the runner's own value."""
    for i, t in enumerate(tail):
        j = start + i
        if j < len(outs):
            if t != PENDING:
                outs[j] = t
        elif t == PENDING:
            raise ValueError("a step message names a pending token this runner never sampled")
        else:
            outs.append(t)
