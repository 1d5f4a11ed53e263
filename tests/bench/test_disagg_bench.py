"""`kdaserve bench disagg` on a tiny model, in one process (the engines stepping in turn): the
second-turn scenarios report the decode side's prefix-hit savings, positive when the
follow-ups extend the first turn (prompt, answer, new user turn) and zero when they share
nothing with it; greedy output equals colocated in both turns; the held tokens' latents do
not cross the wire (the hit query): the second turn's bytes with the hits are those without
them less exactly those latents."""

from __future__ import annotations

import pytest
from tiny_models import random_model, tiny_config

from kdaserve.bench.disagg import measure
from kdaserve.model.loader import save_model

DECODE_BLOCK = 8


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny_disagg_bench")
    save_model(random_model(tiny_config()), model)
    # answers of 9 tokens cross a decode block boundary after any prompt not ending on one:
    # the decode side snapshots there, and the follow-up hits up to it
    return measure(str(model), long_len=24, num_long=1, short_len=5, num_short=1,
                   max_tokens=9, prefill_block=4, decode_block=DECODE_BLOCK,
                   cache_memory=8 << 20, seed=0, num_chats=3, chat_len=40, turn_len=5,
                   engine_args={"num_threads": 1, "max_num_batched_tokens": 16})


def test_follow_ups_hit_the_decode_side(result):
    assert result["identical"] and result["errors"] == []
    turns = result["turns"]
    assert turns["prefix_caching"] == {"prefill": True, "decode": True}
    t = turns["follow_up"]
    assert t["identical"] and t["identical_turn2"] and t["errors"] == []
    skipped = t["decode_skipped"]
    assert skipped["tokens"] > 0 and skipped["tokens"] == t["turn2"]["decode_prefix_hit_tokens"]
    assert skipped["blocks"] * DECODE_BLOCK == skipped["tokens"]      # whole decode blocks
    latent = result["bytes_per_long_request_mla"] // result["long_len"]
    assert skipped["mla_bytes"] == skipped["tokens"] * latent > 0
    assert skipped["kda_bytes"] == 0 and 0 < skipped["frac_of_prompt_mla_bytes"] < 1
    assert t["turn1"]["decode_prefix_hit_tokens"] == 0
    assert t["turn2"]["prefill_prefix_hit_tokens"] > 0        # the prefill side holds turn 1
    for turn in ("turn1", "turn2"):
        b = t[turn]["bytes_per_request"]
        assert b["mla"] > 0 and b["kda"] > 0
    # the KDA state is fixed in size and always travels; the held latents stay home
    assert t["turn1"]["bytes_per_request"]["kda"] == t["turn2"]["bytes_per_request"]["kda"]
    wire = t["wire_bytes"]
    assert wire["with_hits"]["kda"] == wire["without_hits"]["kda"]
    assert wire["without_hits"]["mla"] - wire["with_hits"]["mla"] == skipped["mla_bytes"]
    assert wire["saved"] == skipped["mla_bytes"] and 0 < wire["saved_frac"] < 1
    without = t["transfer_per_request"]["without_hits"]
    assert without["bytes_per_request"]["mla"] > t["turn2"]["bytes_per_request"]["mla"]
    assert without["decode_prefix_hit_tokens"] == 0
    for side in ("with_hits", "without_hits"):
        secs = t["transfer_per_request"][side]
        assert secs["send_s"] > 0 and secs["receive_s"] > 0


def test_unrelated_follow_ups_save_nothing(result):
    t = result["turns"]["fresh"]
    assert t["identical"] and t["identical_turn2"] and t["errors"] == []
    assert t["decode_skipped"] == {"tokens": 0, "blocks": 0, "mla_bytes": 0, "kda_bytes": 0,
                                   "per_request": {"tokens": 0.0, "blocks": 0.0,
                                                   "mla_bytes": 0},
                                   "frac_of_prompt_mla_bytes": 0.0}
    assert t["wire_bytes"]["saved"] == 0
    assert t["wire_bytes"]["with_hits"] == t["wire_bytes"]["without_hits"]
    assert t["turn2"]["prefill_prefix_hit_tokens"] == 0
    assert t["turn2"]["decode_prefix_hit_tokens"] == 0
    # the mixed load (prefix caching off) keeps its fields
    assert result["decode_prefix_hit_tokens"] == 0
    assert result["bytes_per_request"]["mla"] > 0 and result["bytes_per_request"]["kda"] > 0
