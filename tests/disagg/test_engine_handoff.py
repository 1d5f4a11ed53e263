"""Two engines in one process, a prefill and a decode instance, move each request's cache over
a real ZeroMQ socket on loopback: greedy output equals the colocated engine's, token for token,
over prompts of several lengths, different block sizes on the two sides, prefix-cache hits on
the prefill side and speculative decoding (n-gram) on the decode side, for Kimi Linear and for
K3 (attention residuals, MXFP4 experts), one request at a time and all at once, and for
Kimi Linear again with the NIXL connector (the decode side READs the buffers); a transfer
whose KDA states (or one KDA layer's) are dropped fails that equality (the mutation test: the
check catches the failure the field shipped)."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.disagg import wire
from kdaserve.disagg.connector import Arrived
from kdaserve.disagg.local import run_colocated, run_disaggregated

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 8, 13, 37)]


def tokens(traces) -> list[list[int]]:
    assert all(t.error is None for t in traces), [t.error for t in traces]
    return [t.tokens for t in traces]


@pytest.fixture(scope="module", params=[("kimi_linear", "zmq"), ("k3_mxfp4", "zmq"),
                                        ("kimi_linear", "nixl")], ids="-".join)
def engines(request, tmp_path_factory):
    """The prefill engine also gives the colocated reference (a request without
    kv_transfer_params runs whole there), which leaves its prefix cache warm for the
    disaggregated runs: they hit it."""
    name, connector = request.param
    if connector == "nixl":
        pytest.importorskip("nixl", reason="nixl is not installed (pip install "
                                           "'kdaserve[disagg]')")
    if name == "kimi_linear":
        model, vocab = request.getfixturevalue("hf_checkpoint")
        model, vocab = str(model), vocab.config.vocab_size
    else:                  # attention residuals, full-rank KDA gate, MXFP4 routed experts
        from k3_models import k3_raw, write_k3_checkpoint

        out = tmp_path_factory.mktemp("k3")
        write_k3_checkpoint(out, k3_raw(mxfp4=True), seed=5)
        model, vocab = str(out), 96
    common = {"num_threads": 1, "kv_connector": connector}
    # chunks of 8 tokens: a long prompt's blocks are pushed while its next chunks compute
    pre = LLM(model, block_size=4, role="prefill", enable_prefix_caching=True,
              state_snapshot_interval=4, max_num_batched_tokens=8, **common)
    dec = LLM(model, block_size=8, role="decode", kv_transfer_port=0,
              speculative_method="ngram", num_speculative_tokens=2,
              speculative_adaptive=False, **common)
    assert {pre.engine.transfer.connector.transport,
            dec.engine.transfer.connector.transport} == {connector}
    ps = prompts(vocab)
    expected = tokens(run_colocated(pre.engine, ps, GREEDY))
    # a prompt that holds its own continuation: the n-gram drafter finds drafts
    ps.append(ps[2] + expected[2] + ps[2])
    expected += tokens(run_colocated(pre.engine, ps[-1:], GREEDY))
    yield pre, dec, ps, expected, name
    for e in (pre, dec):
        e.engine.transfer.connector.close()


def test_disaggregated_equals_colocated(engines):
    pre, dec, ps, expected, name = engines
    for p, want in zip(ps, expected):               # one at a time
        assert tokens(run_disaggregated(pre.engine, dec.engine, [p], GREEDY)) == [want]
    # all at once: batched on both sides, requests moving over while others prefill
    assert tokens(run_disaggregated(pre.engine, dec.engine, ps, GREEDY)) == expected
    assert pre.engine.cache.stats.hit_tokens > 0
    if name == "kimi_linear":     # the K3 prompts give the n-gram drafter no match
        assert dec.engine.scheduler.num_draft_tokens > 0
    for e in (pre, dec):          # no pages or slots left behind on either side
        assert e.engine.cache.block_pool.num_free == e.engine.cache.block_pool.num_blocks
        assert e.engine.cache.state_pool.num_free == e.engine.cache.state_pool.num_slots
    stats = dec.engine.transfer.connector.stats
    assert stats.pending == 0 and stats.taken == 2 * len(ps)
    sent = pre.engine.transfer.connector.stats
    assert sent.sent == 2 * len(ps) and sent.sent_mla_bytes > 0 and sent.sent_kda_bytes > 0
    assert sent.parts_pushed > 0


def _zero(names):
    def tamper(got: Arrived) -> Arrived:
        frames, specs = [], []
        for f, s in zip(got.frames, got.header.buffers):
            if s.name in names:
                f = memoryview(bytes(len(f)))        # what a sender that skips them delivers
                s = wire.BufferSpec(s.name, s.dtype, s.shape, s.nbytes, wire.checksum(f))
            frames.append(f)
            specs.append(s)
        import msgspec
        return Arrived(msgspec.structs.replace(got.header, buffers=specs), frames)
    return tamper


def test_dropping_kda_states_fails_the_equality(engines):
    pre, dec, ps, expected, _ = engines
    layout = dec.engine.transfer.layout
    nk = len(layout.kda_layers)
    all_kda = {f"kda_state.{j}" for j in range(nk)} | {f"kda_conv.{j}" for j in range(nk)}
    cases = [all_kda] + [{f"kda_state.{j}", f"kda_conv.{j}"} for j in range(nk)]
    p, want = ps[-2], expected[-2]
    for names in cases:
        got = tokens(run_disaggregated(pre.engine, dec.engine, [p], GREEDY, _zero(names)))
        assert got != [want], f"a transfer without {sorted(names)} went unnoticed"
    assert dec.engine.cache.state_pool.num_free == dec.engine.cache.state_pool.num_slots


def test_decode_side_prefix_hits(engines):
    """A second turn (the first turn's prompt and answer, then more) hits the decode
    instance's own prefix cache (its blocks of 8 and the snapshot it took while decoding the
    first turn): those blocks are shared, neither sent (the hit query) nor written again, and
    the output is unchanged."""
    pre, dec, ps, expected, _ = engines
    first = ps[4]
    sent = pre.engine.transfer.connector.stats
    mla = sent.sent_mla_bytes
    assert tokens(run_disaggregated(pre.engine, dec.engine, [first], GREEDY)) == [expected[4]]
    per_token = (sent.sent_mla_bytes - mla) // len(first)
    second = first + expected[4] + ps[1][:3]
    want = tokens(run_colocated(pre.engine, [second], GREEDY))
    stats = dec.engine.cache.stats
    before, mla = stats.hit_tokens, sent.sent_mla_bytes
    assert tokens(run_disaggregated(pre.engine, dec.engine, [second], GREEDY)) == want
    assert stats.hit_tokens - before == 40          # 5 blocks of 8, up to the snapshot at 40
    assert sent.sent_mla_bytes - mla == per_token * (len(second) - 40)
    assert dec.engine.cache.state_pool.num_free == dec.engine.cache.state_pool.num_slots
