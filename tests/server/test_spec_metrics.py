"""/metrics' speculative-decoding histogram (tokens per verified block) and accepted drafts by
position, from the engine's counters (kdaserve/server/metrics.py)."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kdaserve import LLM, SamplingParams
from kdaserve.engine.wire import EngineStatsSnapshot
from kdaserve.server.metrics import ServerMetrics


def _snapshot(**kw) -> dict:
    base = dict(num_running=0, num_waiting=0, cache_usage=0.0, num_free_blocks=1,
                num_free_slots=1, num_blocks=1, all_free=True, prefix_cache_queries=0,
                prefix_cache_hits=0, prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0,
                state_snapshots=0, state_snapshot_bytes=0, prompt_tokens=0,
                generation_tokens=0, preemptions=0, steps=0)
    snap = EngineStatsSnapshot(**base, **kw)
    # the wire's round trip, as the server receives it
    return msgspec.structs.asdict(msgspec.json.decode(msgspec.json.encode(snap),
                                                      type=EngineStatsSnapshot))


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_histogram_and_positions_render():
    text = ServerMetrics().render(_snapshot(
        spec_acceptance_lengths={1: 3, 3: 2}, spec_accepted_by_position={0: 2, 1: 2})).decode()
    s = _samples(text)
    h = "kdaserve:spec_decode_acceptance_length"
    assert [s[(f"{h}_bucket", (("le", le),))] for le in ("1.0", "2.0", "3.0", "+Inf")] == \
        [3, 3, 5, 5]
    assert s[(f"{h}_count", ())] == 5 and s[(f"{h}_sum", ())] == 9
    p = "kdaserve:spec_decode_accepted_by_position_total"
    assert s[(p, (("position", "0"),))] == 2 and s[(p, (("position", "1"),))] == 2
    assert h not in ServerMetrics().render(_snapshot()).decode()    # no drafts: no histogram


def test_seconds_counters_render():
    s = _samples(ServerMetrics().render(_snapshot(
        spec_draft_seconds=1.5, spec_verify_seconds=2.0, spec_dormant_seconds=0.25)).decode())
    assert s[("kdaserve:spec_decode_draft_seconds_total", ())] == 1.5
    assert s[("kdaserve:spec_decode_verify_seconds_total", ())] == 2.0
    assert s[("kdaserve:spec_decode_dormant_seconds_total", ())] == 0.25


def test_engine_counters_agree():
    llm = LLM(max_num_seqs=2, num_threads=1, speculative_method="ngram",
              num_speculative_tokens=3, speculative_adaptive=False)
    prompt = llm.tokenizer.encode("ROMEO:\nROMEO:\nROMEO:\n")
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    s = llm.engine.scheduler
    # the request's own mean acceptance length: tokens per verified block
    assert out.acceptance_length == 1 + s.num_accepted_tokens / s.num_verify_rows
    st = llm.engine.stats
    assert st.spec_draft_seconds > 0 and st.spec_verify_seconds > 0
    assert st.spec_dormant_seconds == 0            # a fixed k: the drafter never sleeps
    assert sum(s.acceptance_lengths.values()) == s.num_verify_rows > 0
    assert sum(k * v for k, v in s.acceptance_lengths.items()) == \
        s.num_accepted_tokens + s.num_verify_rows
    assert sum(s.accepted_by_position.values()) == s.num_accepted_tokens
    assert all(s.accepted_by_position[j] >= s.accepted_by_position[j + 1] for j in range(2))
