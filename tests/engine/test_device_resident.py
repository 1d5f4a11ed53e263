"""The device-resident decode step, checked on CPU through the torch forward: during a decode
step's layout and forward no tensor is read back to Python, its inputs keep their storage from
step to step, and its greedy output equals the other forwards' (kdaserve/engine/decode_inputs.py).
The CUDA path runs the same code; CUDA graphs and the GPU kernels are checked on a GPU only."""

from __future__ import annotations

import os

import pytest
import torch
from no_reads import no_reads
from sub_pytest import torch_forms_outcome

from kdaserve import LLM, SamplingParams
from kdaserve.assets import default_model_path, kimi_linear_demo_path


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (5, 23, 40)]


def _generate(model: str, monkeypatch, resident: str, fused: str, watch=None):
    monkeypatch.setenv("KDASERVE_DEVICE_RESIDENT", resident)
    monkeypatch.setenv("KDASERVE_FUSED_DECODE", fused)
    llm = LLM(model, max_num_seqs=4, cache_memory=64 << 20, num_threads=1,
              enable_prefix_caching=False)
    if watch is not None:
        watch(llm.engine.runner)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model", [kimi_linear_demo_path, default_model_path],
                         ids=["kimi_linear_demo", "k3_demo"])
def test_decode_steps_never_read_back_and_keep_their_inputs(model, monkeypatch):
    seen = {"steps": 0, "ptrs": set()}

    def watch(runner):
        plan_step, forward = runner.plan, runner.forward

        def decode_only(seqs):
            return seqs and all(s.is_decode and len(s.token_ids) == 1 for s in seqs)

        def plan(seqs, ops):
            if not decode_only(seqs):
                return plan_step(seqs, ops)
            with no_reads():
                p = plan_step(seqs, ops)
            assert p.fb is not None and p.fb.sync_free
            seen["steps"] += 1
            seen["ptrs"].add((p.ids.untyped_storage().data_ptr(),
                              p.fb.positions.untyped_storage().data_ptr(),
                              p.fb.state_slots.untyped_storage().data_ptr(),
                              runner.decode_inputs.table.untyped_storage().data_ptr()))
            return p

        def fwd(p, drafting=True):
            if p.fb is None or not p.fb.sync_free:
                return forward(p, drafting)
            with no_reads():
                return forward(p, drafting)

        runner.plan, runner.forward = plan, fwd

    resident = _generate(model(), monkeypatch, "1", "0", watch)
    assert seen["steps"] >= 10
    assert len(seen["ptrs"]) == 1, "a decode step's inputs moved to new storage"
    # the same tokens as the torch forward without persistent inputs, and as the CPU path
    assert resident == _generate(model(), monkeypatch, "0", "0")
    assert resident == _generate(model(), monkeypatch, "0", "1")


@pytest.mark.parametrize("tokens", [1, 2, 5])     # T*k below and above the 6 experts
def test_the_sync_free_moe_routing_equals_the_grouped_one(tokens):
    """Both sync-free forms (gathered weights, every expert) against the grouped form."""
    from tiny_models import random_model, tiny_config

    moe = random_model(tiny_config()).model.layers[1].block_sparse_moe
    x = torch.randn(tokens, moe.width, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        weights, ids = moe.gate(x)
        want = moe._routed(x, weights, ids)
        with no_reads():
            got = moe._routed(x, weights, ids, sync_free=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)   # the sums run in
    # another order


@pytest.mark.skipif(os.environ.get("KDASERVE_CPU_KERNELS") == "0",
                    reason="already running on the torch forms")
def test_the_same_with_the_torch_forms_the_gpu_runs():
    """Without the compiled CPU kernels every op is the torch form CUDA runs (the MoE takes
    its sync-free routing): the same checks, in a process of their own (the kernels' choice
    is made once per process)."""
    passed, why = torch_forms_outcome("tests/engine/test_device_resident.py")
    assert passed == 2, why
