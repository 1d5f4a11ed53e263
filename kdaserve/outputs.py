"""Records that cross module boundaries: scheduler -> runner -> scheduler -> user."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.cache.ops import CacheOp, CacheOutcome, FreeRequest
from kdaserve.request import SamplingParams


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step: `token_ids` at positions context_len.. are computed."""

    request_id: str
    token_ids: list[int]
    context_len: int
    block_ids: list[int]
    state_slot: int
    sample: bool                      # the chunk ends at the last known token: sample one
    num_draft_tokens: int = 0         # the last len(...) token_ids are drafts to verify
    media: tuple = ()                 # MediaItems whose placeholders overlap token_ids

    @property
    def is_decode(self) -> bool:
        """A decode row: one token with context in the cache, or a token and its drafts to
        verify. The forward packs these first (kdaserve/model/batch.py); the only definition."""
        return self.context_len > 0 and (len(self.token_ids) == 1 or self.num_draft_tokens > 0)


@dataclass
class RequestData:
    """What a runner keeps of one request (kdaserve/engine/step_message.py): sent whole the
    first time the runner sees it (`prompt_token_ids`, `params` set), then as the tail of its
    output tokens: `output_token_ids` replace the runner's copy from index `output_start` on."""

    output_start: int
    output_token_ids: list[int]
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    preempted: list[str] = field(default_factory=list)
    ops: list[CacheOp] = field(default_factory=list)
    # every cache tensor movement of the step, in order (kdaserve/cache/ops.py says when each
    # kind runs): frees, offload stores/loads/drops, restores, snapshots, settling drafts

    draft_limits: dict[str, int] | None = None
    # speculation: how many drafts to propose for each request's next step (absent: the most)
    drafting: bool = True
    # False while adaptive speculation's drafter sleeps: no hidden-state capture, no proposals
    num_steps: int = 1
    # multi-step decoding (engine/decode_burst.py): forwards this step's decode rows run, each
    # feeding the token the one before sampled
    request_data: dict[str, RequestData] = field(default_factory=dict)
    # what the runner needs of each scheduled request besides its tokens (prompt, params,
    # output so far): filled on rank 0 before the step leaves the engine core
    dp_ranks: dict[str, int] = field(default_factory=dict)
    # attention data parallel: the rank that runs each scheduled request (filled by the
    # executor, kdaserve/distributed/data_parallel.py)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences

    @property
    def finished(self) -> list[str]:
        """Requests freed since the last step."""
        return [op.request_id for op in self.ops if isinstance(op, FreeRequest)]

    def ops_of(self, kind: type) -> list:
        return [op for op in self.ops if isinstance(op, kind)]


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class ModelRunnerOutput:
    """sampled: the new tokens of each request that sampled (one, or with speculation the
    accepted drafts followed by the correction/bonus token). drafts: proposals to verify next
    step. cache: the outcome of the step's cache operations (failed entries; a failed load's
    request was left out of the step; snapshots planned but never written)."""

    sampled: dict[str, list[SampledToken]]
    drafts: dict[str, list[int]] = field(default_factory=dict)
    cache: CacheOutcome = field(default_factory=CacheOutcome)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # requests asking for prompt logprobs: (first prompt position scored, its entries)
    grammar_errors: dict[str, str] = field(default_factory=dict)
    # requests whose grammar matcher failed: they end with an error, not unconstrained
    draft_seconds: float = 0.0
    # host seconds the proposer took this step (capture projection and draft forward)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    acceptance_length: float | None = None
    # speculation: mean tokens per verified block (accepted drafts + 1); None: none verified
    spec_verifications: int = 0     # blocks of drafts verified for this completion


@dataclass
class RequestMetrics:
    """When an offline request (LLM.generate) was added, got its first and its last token,
    and finished: time.perf_counter() seconds (vLLM's RequestOutput.metrics names, on a
    monotonic clock). A request's decode time is last_token_time - first_token_time, without
    its prompt's prefill."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None   # entry 0 None
    metrics: RequestMetrics | None = None


@dataclass
class RequestDelta:
    """What one step added to one (child) request: the unit the server streams."""

    request_id: str                 # the user's request id
    index: int                      # which of its n completions
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None        # the engine failed this request (finish_reason "error")
    prompt_logprobs: list[dict[int, float] | None] | None = None   # with the first tokens
    # speculation, on the final delta: blocks of drafts verified and drafts accepted
    spec_verifications: int = 0
    spec_accepted_tokens: int = 0

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens per verified block (accepted drafts + 1); None: none verified."""
        if not self.spec_verifications:
            return None
        return 1.0 + self.spec_accepted_tokens / self.spec_verifications
