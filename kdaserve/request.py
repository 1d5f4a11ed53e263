"""Requests and their sampling parameters (the only mutable per-request record)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kdaserve.disagg.params import KVTransferParams
from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError


class RequestError(ValueError):
    """A request field is invalid. `param` names the field (the server's HTTP 400 reports it),
    so nothing has to read it back out of the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingParamsError(RequestError):
    """An invalid sampling parameter."""


# The documented ranges (docs/reliability.md). Integers are bounded so that nothing downstream
# (torch tensors, msgpack, generator seeds) can overflow on user input.
MAX_N = 128                      # completions per prompt
MAX_INT32 = 2**31 - 1            # max_tokens, min_tokens, top_k, stop_token_ids
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1   # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096            # all stop strings together
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024            # entries in logit_bias
LOGIT_BIAS_RANGE = 100.0         # each bias in [-100, 100] (OpenAI's range)
SAMPLING_EPS = 1e-5              # temperatures below this sample greedily (as vLLM does)


# an output token sampled by a step still in flight (async scheduling): its value is the
# runner's until the step's result comes back
PENDING = -1


def child_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded `seed` (wraps within uint64)."""
    return (seed + index) % 2**64


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """What to generate and how; field names and defaults follow vLLM's."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedDecoding | None = None       # structured outputs (kdaserve/structured)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    prompt_logprobs: int | None = None          # logprobs of each prompt token (top-k extra)
    # prefill/decode disaggregation: this request's cache goes to, or comes from, another
    # instance (kdaserve/disagg/params.py)
    kv_transfer: KVTransferParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        if 0.0 < self.temperature < SAMPLING_EPS:
            # logits / 1e-45 overflow to inf and softmax to NaN: such a temperature is greedy
            self.temperature = 0.0

    @property
    def penalised(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def _check(self) -> None:
        def bad(name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}", name)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.kv_transfer is not None and self.n != 1:
            raise SamplingParamsError("kv_transfer_params needs n = 1 (one cache per request)",
                                      "kv_transfer_params")
        if self.max_tokens is not None and (not _is_int(self.max_tokens)
                                            or not 1 <= self.max_tokens <= MAX_INT32):
            raise bad("max_tokens", f"must be an integer in [1, {MAX_INT32}]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            raise bad("min_tokens", f"must be an integer in [0, {MAX_INT32}]")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise bad(name, "must be a number")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise bad("top_k", f"must be 0/-1 (off) or an integer in [1, {MAX_INT32}]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                "stop")
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise SamplingParamsError(
                f"stop strings total {sum(len(s) for s in self.stop)} characters; at most "
                f"{MAX_STOP_CHARS} are allowed", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(f"stop_token_ids has {len(self.stop_token_ids)} entries; "
                                      f"at most {MAX_STOP_TOKEN_IDS} are allowed",
                                      "stop_token_ids")
        if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be integers in [0, {MAX_INT32}]")
        self._check_extras()

    def _check_extras(self) -> None:
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecoding):
                raise SamplingParamsError("guided must be a GuidedDecoding", "guided")
            try:
                self.guided.check()
            except GuidedDecodingError as exc:
                raise SamplingParamsError(f"guided: {exc}", "guided") from None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases",
                    "logit_bias")
            for tid, bias in self.logit_bias.items():
                if not _is_int(tid) or not 0 <= tid <= MAX_INT32:
                    raise SamplingParamsError(f"logit_bias keys must be token ids in "
                                              f"[0, {MAX_INT32}], got {tid!r}", "logit_bias")
                if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias
                        or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
                    raise SamplingParamsError(f"logit_bias values must be numbers in "
                                              f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                              f"got {bias!r} for token {tid}", "logit_bias")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                      f"{self.prompt_logprobs!r}", "prompt_logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One sequence being generated. `n > 1` prompts become n requests sharing a prefix."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    max_model_len: int | None = None
    cache_salt: str | None = None
    extra_keys: tuple = ()
    media: tuple = ()               # MediaItems (kdaserve/media.py): images in the prompt
    group: str = ""                 # fairness unit: all sequences of one client request
    # a sibling that computes the prompt (and its logprobs) for this one: it is admitted
    # once that prompt is computed, and takes it as a prefix hit (engine/prompt_logprobs.py)
    prompt_leader: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: one entry per prompt token (see
    # engine/prompt_logprobs.py), entry 0 None
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    spec_token_ids: list[int] = field(default_factory=list)   # drafts to verify next step
    num_draft_tokens: int = 0           # drafts verified so far (speculative decoding stats)
    num_accepted_tokens: int = 0        # of which accepted
    num_spec_verifications: int = 0     # steps that verified its drafts (blocks verified)
    # async scheduling (engine/lookahead.py): output tokens sampled by steps still in flight,
    # held at the end of output_token_ids as PENDING until their step's result arrives
    num_pending: int = 0

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known_outputs(self) -> int:
        """Output tokens whose values are known (the rest are PENDING, in flight)."""
        return len(self.output_token_ids) - self.num_pending

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step's token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        limit = self.sampling_params.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - self.num_prompt_tokens
            limit = room if limit is None else min(limit, room)
        return limit if limit is not None else 1 << 30

    @property
    def is_finished(self) -> bool:
        return self.status.finished
