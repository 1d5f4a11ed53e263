"""The whole GPU decode path short of CUDA itself: an engine over a tiny random Kimi Linear with
decode graphs (the replay backend on CPU), persistent inputs, the Triton kernels (KDA decode,
paged MLA decode, grouped MoE) and device sampling gives the same greedy and seeded-sampled
tokens as the eager engine on the torch references. On CUDA the same test runs real graphs."""

from __future__ import annotations

import pytest
import torch
from capture_safety import CaptureSafety
from tiny_models import random_model, tiny_config

from kdaserve.engine.args import EngineArgs
from kdaserve.engine.core import EngineCore
from kdaserve.ops import gpu, registry
from kdaserve.ops.gpu import kda_decode, mla_decode, moe_grouped
from kdaserve.request import SamplingParams

pytestmark = pytest.mark.gpu


def _run(model, device, graphs: bool, monkeypatch) -> list[list[int]]:
    monkeypatch.setenv("KDASERVE_DECODE_GRAPHS", "replay" if graphs and device.type == "cpu"
                       else ("" if graphs else "0"))
    monkeypatch.setenv("KDASERVE_DEVICE_RESIDENT", "1")
    monkeypatch.setenv("KDASERVE_FUSED_DECODE", "0")
    monkeypatch.setenv("KDASERVE_DEVICE_SAMPLING", "1" if graphs else "0")
    config = EngineArgs.from_kwargs(
        "test", device=str(device), dtype="float32", max_num_seqs=4, max_model_len=64,
        cache_memory=8 << 20, block_size=4, kda_chunk_size=4,
        enable_prefix_caching=False).to_engine_config()
    eng = EngineCore(config, model=model)
    if graphs:
        assert eng.runner.graphs is not None and sorted(eng.runner.graphs.steps) == [1, 2, 4]
        replay = eng.runner.graphs.replay

        def safe_replay(size):          # what a CUDA capture refuses (tests/capture_safety.py)
            with CaptureSafety():
                return replay(size)
        eng.runner.graphs.replay = safe_replay
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (m,), generator=g).tolist() for m in (5, 11, 14)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    out: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
        out[f"r{i}"] = []
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id] += d.new_token_ids
    return [out[f"r{i}"] for i in range(3)]


def test_engine_with_graphs_and_kernels_equals_the_eager_references(monkeypatch, device):
    torch.set_num_threads(1)            # torch's workers spin against the interpreter
    cfg = tiny_config(linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3],
                                          "num_heads": 2, "head_dim": 16,
                                          "short_conv_kernel_size": 4})
    calls = {"kda": 0, "mla": 0, "moe": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    for mod, fn, name in ((kda_decode, "kda_recurrent_slots_triton", "kda"),
                          (mla_decode, "mla_decode_split_k_triton", "mla"),
                          (moe_grouped, "fused_moe", "moe")):
        monkeypatch.setattr(mod, fn, spy(name, getattr(mod, fn)))
    for c in (registry._interpreted_ops, registry._cuda_ops):
        c.cache_clear()
    got = _run(random_model(cfg, seed=1, chunk=4).to(device), device, True, monkeypatch)
    assert min(calls.values()) > 0, calls
    monkeypatch.setattr(gpu, "kernels_for", lambda device_type: False)
    for c in (registry._interpreted_ops, registry._cuda_ops):
        c.cache_clear()
    want = _run(random_model(cfg, seed=1, chunk=4), torch.device("cpu"), False, monkeypatch)
    assert got == want and all(len(t) == 6 for t in want)
