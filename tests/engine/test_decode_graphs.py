"""Decode steps replayed from captured graphs (kdaserve/engine/decode_graphs.py), checked on CPU
with the replay backend (KDASERVE_DECODE_GRAPHS=replay: the recorded step is called again, over
the same persistent buffers, padding and in-graph layout refresh that a CUDA graph replays).
Real CUDA graphs are checked on a GPU (`kdaserve bench cuda`)."""

from __future__ import annotations

import os

import pytest
import torch
from capture_safety import CaptureSafety
from no_reads import no_reads
from sub_pytest import torch_forms_outcome

from kdaserve import LLM, SamplingParams
from kdaserve.assets import default_model_path, kimi_linear_demo_path
from kdaserve.engine.decode_graphs import graph_sizes
from kdaserve.engine.decode_inputs import DecodeInputs
from kdaserve.model.batch import build_forward_batch
from kdaserve.model.layout.mla import refresh_decode
from kdaserve.outputs import ScheduledSequence


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    # 3 rows (padded to 4), two of them sharing a 34-token prefix: prefix hits, and decode
    # rows crossing block boundaries take snapshots
    shared = torch.randint(4, vocab, (34,), generator=g).tolist()
    return [shared + [7, 8], torch.randint(4, vocab, (21,), generator=g).tolist(),
            shared + [9]]


def _generate(model: str, monkeypatch, graphs: str, fused: str, watch=None):
    monkeypatch.setenv("KDASERVE_DECODE_GRAPHS", graphs)
    monkeypatch.setenv("KDASERVE_DEVICE_RESIDENT", "1")
    monkeypatch.setenv("KDASERVE_FUSED_DECODE", fused)
    llm = LLM(model, max_num_seqs=4, max_model_len=256, cache_memory=64 << 20,
              num_threads=1, block_size=16)
    if watch is not None:
        watch(llm.engine.runner)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = []
    for batch in (prompts[:2], prompts[2:]):    # the second run hits the first's prefix
        outs += llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    # the first request's text and output: its prefix hit reaches the snapshot at 48 tokens,
    # taken by a decode step (a replay, with graphs)
    again = prompts[0] + list(outs[0].outputs[0].token_ids[:14])
    outs += llm.generate([{"prompt_token_ids": again}], sp, use_tqdm=False)
    assert outs[2].num_cached_tokens == 32 and outs[3].num_cached_tokens == 48
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model", [kimi_linear_demo_path, default_model_path],
                         ids=["kimi_linear_demo", "k3_demo"])
def test_graph_replays_give_the_eager_tokens_and_read_nothing_back(model, monkeypatch):
    seen = {"replays": 0, "sizes": set(), "ptrs": set(), "snapshots": 0}

    def watch(runner):
        assert runner.graphs is not None and sorted(runner.graphs.steps) == [1, 2, 4]
        forward, replay = runner._forward_graph, runner.graphs.replay

        def safe_replay(size):            # what a CUDA graph capture would refuse, in the
            with CaptureSafety():         # torch forms CUDA runs (the CPU kernels differ)
                return replay(size)
        if os.environ.get("KDASERVE_CPU_KERNELS") == "0":
            runner.graphs.replay = safe_replay

        def fwd(plan, capture):
            seen["replays"] += 1
            seen["sizes"].add((len(plan.seqs), plan.graph))
            seen["ptrs"].add(plan.ids.untyped_storage().data_ptr())
            seen["snapshots"] += len(plan.snapshots)
            with no_reads():
                return forward(plan, capture)
        runner._forward_graph = fwd

    graphs = _generate(model(), monkeypatch, "replay", "0", watch)
    assert seen["replays"] >= 20
    assert (3, 4) in seen["sizes"] or (2, 2) in seen["sizes"]
    assert len(seen["ptrs"]) == 1
    assert seen["snapshots"] > 0         # decode rows crossed block boundaries in replays
    assert graphs == _generate(model(), monkeypatch, "0", "0")      # eager, torch forward
    assert graphs == _generate(model(), monkeypatch, "0", "1")      # the CPU path


@pytest.mark.skipif(os.environ.get("KDASERVE_CPU_KERNELS") == "0",
                    reason="already running on the torch forms")
def test_the_same_in_the_torch_forms_a_capture_accepts():
    """Without the compiled CPU kernels every op is the torch form CUDA runs: the replays run
    under CaptureSafety (nothing a CUDA graph capture refuses), in a process of their own."""
    passed, why = torch_forms_outcome("tests/engine/test_decode_graphs.py")
    assert passed == 2, why


def test_enforce_eager_captures_nothing(monkeypatch):
    monkeypatch.setenv("KDASERVE_DECODE_GRAPHS", "replay")
    llm = LLM(max_num_seqs=2, max_model_len=64, cache_memory=16 << 20, enforce_eager=True)
    assert llm.engine.runner.graphs is None


def test_the_in_graph_refresh_rebuilds_the_layout_of_each_step():
    """A decode layout built once over the buffers, refreshed after new inputs are written,
    equals the layout built afresh from those inputs."""
    from tiny_models import random_model, tiny_config

    model = random_model(tiny_config())
    from kdaserve.model.hybrid_cache import HybridCache

    cache = HybridCache.allocate(model.config, 40, 4, 9)
    inputs = DecodeInputs(torch.device("cpu"), rows=4, width=8, fixed=True)
    inp = inputs.fill([], pad_to=4, pad_slot=8, pad_block=39)
    fb = build_forward_batch([1] * 4, [1] * 4, num_decode=4, cache=cache,
                             block_tables=inp.block_table, state_slots=inp.slots,
                             positions=inp.positions, sync_free=True, decode_width=8)
    seqs = [ScheduledSequence(f"r{i}", [5 + i], ctx,
                              list(range(3 * i, 3 * i + -(-(ctx + 1) // 4))), i, True)
            for i, ctx in enumerate((3, 9, 4))]
    inputs.fill(seqs, pad_to=4, pad_slot=8, pad_block=39)
    with no_reads():
        refresh_decode(fb.mla, inp.positions, inp.block_table, 4)
    fresh = build_forward_batch([1] * 3, [s.context_len for s in seqs], num_decode=3,
                                cache=cache, block_tables=[s.block_ids for s in seqs],
                                state_slots=[s.state_slot for s in seqs])
    got, want = fb.mla, fresh.mla
    assert torch.equal(got.slot_mapping[:3], want.slot_mapping)
    assert got.slot_mapping[3] == 39 * 4                  # the padding row: its own block
    assert torch.equal(got.decode_kv_lens[:3], want.decode_kv_lens)
    w = want.decode_ctx_blocks.shape[1]
    assert torch.equal(got.decode_ctx_blocks[:3, :w], want.decode_ctx_blocks)
    assert torch.equal(got.decode_ctx_mask[:3, :w * 4], want.decode_ctx_mask)
    assert not got.decode_ctx_mask[:3, w * 4:].any()      # the wider table reads nothing more
    assert torch.equal(fb.state_slots, torch.tensor([0, 1, 2, 8]))


def test_sizes_and_fixed_buffers():
    assert graph_sizes(1) == [1] and graph_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_sizes(48) == [1, 2, 4, 8, 16, 32, 64]
    inputs = DecodeInputs(torch.device("cpu"), rows=2, width=2, fixed=True)
    seq = ScheduledSequence("r", [1], 40, [0, 1, 2], 0, True)
    with pytest.raises(ValueError, match="fixed decode buffers"):
        inputs.fill([seq])


def test_capture_safety_refuses_what_a_capture_refuses():
    x = torch.arange(6.0)
    for bad in (lambda: x.sum().item(), lambda: x[x > 2], lambda: torch.tensor([1, 2]),
                lambda: torch.nonzero(x), lambda: x.repeat_interleave(x.long()),
                lambda: torch.arange(3) + x[:3]):
        with pytest.raises(AssertionError), CaptureSafety():
            bad()
    with CaptureSafety():          # fixed shapes, device-side values: fine
        n = torch.arange(3, device=x.device)
        x.index_select(0, n) * 2 + x[:3].repeat_interleave(n, output_size=3).sum()
