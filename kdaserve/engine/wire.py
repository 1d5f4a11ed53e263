"""The messages between the server and the engine process: typed msgspec Structs, encoded
with msgpack on two ZeroMQ PUSH/PULL pipes (no pickle on the wire). `Command`s flow to the
engine, `Reply`s flow back; a tagged union on each pipe lets one decoder read any of them.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kdaserve.media import MediaWire
from kdaserve.outputs import RequestDelta


# ---- wire messages: server -> engine ---------------------------------------------------------
class AddCmd(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: msgspec.Raw            # an encoded SamplingParams, decoded (validated) by the child
    priority: int = 0
    group: str | None = None       # fairness unit (one HTTP request's prompts share it)
    media: list[MediaWire] = []    # images, their placeholder runs expanded in the prompt
    stream_text: bool = True       # False: the text is read once the request ends


class AbortCmd(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StatsCmd(msgspec.Struct, tag="stats"):
    token: int


class HoldCmd(msgspec.Struct, tag="hold"):
    """Disaggregation's hit query (EngineCore.hold_prefix), answered by a HoldReply."""

    token: int
    transfer_id: str
    prompt_token_ids: list[int]


class ShutdownCmd(msgspec.Struct, tag="shutdown"):
    pass


Command = Union[AddCmd, AbortCmd, StatsCmd, HoldCmd, ShutdownCmd]


# ---- wire messages: engine -> server ---------------------------------------------------------
class EngineInfo(msgspec.Struct, tag="ready"):
    """What the child reports once the model is loaded."""

    max_model_len: int
    vocab_size: int
    plan: str
    num_blocks: int
    block_size: int
    num_state_slots: int


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class DeltaBatch(msgspec.Struct, tag="deltas"):
    deltas: list[RequestDelta]


class AddFailed(msgspec.Struct, tag="add_failed"):
    request_id: str
    message: str
    invalid_input: bool            # True: the request was bad (HTTP 400); False: an engine bug


class EngineStatsSnapshot(msgspec.Struct):
    num_running: int
    num_waiting: int
    cache_usage: float
    num_free_blocks: int
    num_free_slots: int
    num_blocks: int
    all_free: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    state_snapshots: int
    state_snapshot_bytes: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    steps: int
    spec_verifications: int = 0    # decode rows that verified drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # verified blocks by acceptance length (accepted drafts + 1); accepted drafts by position
    spec_acceptance_lengths: dict[int, int] = {}
    spec_accepted_by_position: dict[int, int] = {}
    # seconds: in the proposer, in verifying steps (less the proposer's), with the drafter asleep
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0
    spec_dormant_seconds: float = 0.0
    # adaptive speculation's decisions (kdaserve.engine.spec.adaptive.decisions); {} when off
    spec_adaptive: dict[str, float] = {}
    # offload tiers: tier name -> counters (see kdaserve.engine.tier_transfer.offload_stats)
    offload: dict[str, dict[str, float]] = {}
    # disaggregation: the connector's counters (kdaserve/disagg/connector.py); {} when off
    kv_transfer: dict[str, float] = {}


class StatsReply(msgspec.Struct, tag="stats_reply"):
    token: int
    stats: EngineStatsSnapshot


class HoldReply(msgspec.Struct, tag="hold_reply"):
    token: int
    held_tokens: int
    error: str = ""                # the query was refused (not a decode instance)


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """The loop is alive and stepping (sent between steps and while idle)."""


Reply = Union[EngineInfo, StartupFailed, DeltaBatch, AddFailed, StatsReply, HoldReply, Fatal,
              Heartbeat]
