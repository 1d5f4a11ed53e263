"""The compiled CPU KDA kernel against the torch reference: same outputs, same slot updates,
same per-position states, other slots untouched; and the registry falls back to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compiled_kernels import needs_kernels, require

from kdaserve.ops import kda as ref
from kdaserve.ops.cpu_kernels import kda_recurrent_slots_kernel
from kdaserve.ops.registry import TORCH_KDA, _compiled_recurrent_slots

needs_cc = needs_kernels


def _inputs(B: int, L: int, H: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, L, H, D, generator=g), dim=-1) * D ** -0.5
    k = F.normalize(torch.randn(B, L, H, D, generator=g), dim=-1)
    v = torch.randn(B, L, H, D, generator=g)
    gate = -torch.rand(B, L, H, D, generator=g) * 3
    beta = torch.rand(B, L, H, generator=g)
    return q, k, v, gate, beta


@needs_cc
@pytest.mark.parametrize("B,L,H,D", [(1, 1, 1, 4), (5, 1, 2, 8), (3, 6, 2, 16), (64, 1, 4, 64),
                                     (2, 8, 4, 64)])
def test_compiled_matches_reference(B, L, H, D):
    kernel = require(kda_recurrent_slots_kernel(), "csrc/kda_cpu.c")
    compiled = _compiled_recurrent_slots(kernel)
    S = B + 3
    store = torch.randn(S, H, D, D, generator=torch.Generator().manual_seed(1)) * 0.1
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(2))[:B]
    inputs = _inputs(B, L, H, D, seed=B * 100 + L)
    store_ref = store.clone()
    o_ref, kept_ref = ref.kda_recurrent_slots(store_ref, slots, *inputs, keep_states=L > 1)
    o, kept = compiled(store, slots, *inputs, keep_states=L > 1)
    torch.testing.assert_close(o, o_ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(store, store_ref, atol=2e-6, rtol=1e-5)
    if L > 1:
        torch.testing.assert_close(kept, kept_ref, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(kept[:, -1], store[slots], atol=0, rtol=0)
    others = torch.ones(S, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(store[others], store_ref[others])


@needs_cc
def test_compiled_rows_are_independent_of_batch():
    """A row's result is bitwise the same alone or in a batch (greedy identity relies on it)."""
    compiled = _compiled_recurrent_slots(require(kda_recurrent_slots_kernel(), "csrc/kda_cpu.c"))
    B, L, H, D = 6, 3, 2, 16
    inputs = _inputs(B, L, H, D, seed=7)
    store = torch.randn(B, H, D, D) * 0.1
    alone = store.clone()
    o_all, _ = compiled(store, torch.arange(B), *inputs)
    o_one, _ = compiled(alone, torch.tensor([4]), *(t[4:5] for t in inputs))
    assert torch.equal(o_all[4:5], o_one) and torch.equal(store[4], alone[4])


def test_disabled_kernel_falls_back(monkeypatch):
    from kdaserve.ops import cpu_kernels, registry

    caches = (cpu_kernels._library, cpu_kernels.kda_recurrent_slots_kernel,
              cpu_kernels.kda_prepare_kernel, registry._cpu_ops)
    monkeypatch.setenv("KDASERVE_CPU_KERNELS", "0")
    for c in caches:
        c.cache_clear()
    try:
        assert cpu_kernels.kda_recurrent_slots_kernel() is None
        assert cpu_kernels.kda_prepare_kernel() is None
        assert registry.kda_ops(torch.device("cpu")) is TORCH_KDA
    finally:
        monkeypatch.delenv("KDASERVE_CPU_KERNELS")
        for c in caches:
            c.cache_clear()


def test_training_forward_uses_the_differentiable_ops():
    """A forward that is being trained must not run the compiled kernels (they have no
    autograd): every KDA input parameter gets a gradient."""
    from tiny_models import random_model, tiny_config

    from kdaserve.ops.registry import kda_ops

    assert kda_ops(torch.device("cpu"), needs_grad=True) is TORCH_KDA
    model = random_model(tiny_config()).train()
    # frozen embeddings and first norm: layer 0's input needs no gradient, its weights do
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model.forward_dense(ids).logsumexp(-1).sum().backward()
    for i in (0, 1):
        kda = model.model.layers[i].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj",
                     "q_conv1d"):
            grad = getattr(kda, name).weight.grad
            assert grad is not None and grad.abs().sum() > 0, (i, name)
        moe = model.model.layers[i].ffn
        if hasattr(moe, "experts_w13"):
            assert moe.experts_w13.grad is not None and moe.experts_w13.grad.abs().sum() > 0


@needs_cc
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_compiled_prepare_matches_torch_ops(monkeypatch, lower_bound):
    """The compiled conv/norm/decay prepare against the layer's torch ops, through the model
    with a cache: prefill rows shorter and longer than the conv window, fresh and continued
    sequences, decode rows mixed with prefill rows; logits, states and windows agree."""
    from tiny_models import random_model, tiny_config

    from kdaserve.model import kda as kda_module
    from kdaserve.model.batch import build_forward_batch
    from kdaserve.model.hybrid_cache import HybridCache
    from kdaserve.ops.registry import kda_ops

    assert kda_ops(torch.device("cpu")).prepare is not None
    model = random_model(tiny_config(kda_gate_lower_bound=lower_bound)).fuse_for_inference()
    steps = [  # (seq lens, context lens, decode rows first)
        ([2, 7, 1, 12], [0, 0, 0, 0], 0),
        ([1, 1, 5, 3], [2, 7, 1, 12], 2),
        ([1, 1, 1, 1], [3, 8, 6, 15], 4),
    ]

    def run(ops_for):
        monkeypatch.setattr(kda_module, "kda_ops", ops_for)
        cache = HybridCache.allocate(model.config, 17, 4, 5)
        outs = []
        for lens, ctx, nd in steps:
            fb = build_forward_batch(lens, ctx, num_decode=nd, conv_kernel=4, chunk_size=8,
                                     cache=cache, block_tables=[[1 + 4 * i + j for j in range(4)]
                                                                for i in range(4)],
                                     state_slots=[1, 2, 3, 4])
            ids = torch.randint(0, 64, (sum(lens),), generator=torch.Generator().manual_seed(
                sum(lens)))
            with torch.inference_mode():
                outs.append(model(ids, fb)[0])
        return outs, cache

    compiled, c_cache = run(lambda device, needs_grad=False: kda_ops(device))
    torch_, t_cache = run(lambda device, needs_grad=False: TORCH_KDA)
    for a, b in zip(compiled, torch_):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(c_cache.kda_states + c_cache.kda_conv, t_cache.kda_states + t_cache.kda_conv):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_cc
def test_bench_kda_prints_its_figures(capsys):
    import json

    from kdaserve.cli import main

    assert main(["bench", "kda", "--json", "--iters", "2", "--repeats", "1", "--decode-rows", "4",
                 "--prefill-rows", "2", "--prefill-len", "32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for part in ("decode", "verify", "prefill"):
        assert out[part]["compiled_us"] > 0 and out[part]["speedup"] > 0


def test_engine_greedy_identical_with_torch_reference(hf_checkpoint, monkeypatch):
    """The engine end to end with the torch KDA forms (what CUDA and compiler-less machines
    run) gives the same greedy tokens as the default path, with chunked prefill and decode."""
    from kdaserve import LLM, SamplingParams
    from kdaserve.model import kda as kda_module

    path, hf = hf_checkpoint
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (1, 5, 17, 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def greedy() -> list[list[int]]:
        llm = LLM(str(path), max_num_batched_tokens=16, long_prefill_token_threshold=7)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    default = greedy()
    monkeypatch.setattr(kda_module, "kda_ops", lambda device, needs_grad=False: TORCH_KDA)
    assert greedy() == default


@needs_cc
@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_moe_kernel_matches_torch_experts(T):
    """The ragged-group expert kernel against the padded torch form through SparseMoE, with
    the transposed storage the engine uses (groups of 1..many rows, tails of the 4-row
    blocks); the checkpoint view of the weights is unchanged by the transposition."""
    from tiny_models import tiny_config

    from kdaserve.model.moe import SparseMoE
    from kdaserve.ops.moe_kernel import moe_experts_kernel

    assert moe_experts_kernel() is not None
    cfg = tiny_config(num_experts=8, num_experts_per_token=3, hidden_size=40,
                      moe_intermediate_size=12)
    torch.manual_seed(T)
    moe = SparseMoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, cfg.hidden_size)
    with torch.inference_mode():
        assert moe._ragged_kernel(x) is None          # [E, 2I, H] storage: the torch form
        want = moe(x)
        w13, w2 = moe.experts_w13.clone(), moe.experts_w2.clone()
        moe.transpose_expert_storage()
        assert torch.equal(moe.experts_w13, w13) and torch.equal(moe.experts_w2, w2)
        assert moe._ragged_kernel(x) is not None
        got = moe(x)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_cc
def test_moe_kernel_token_ranges_are_bitwise_independent():
    """The kernel's token-range contract: two calls over halves of the tokens give bitwise the
    result of one call over all (a token's experts are summed in the same order)."""
    import ctypes

    from kdaserve.ops import cpu_kernels, moe_kernel

    assert moe_kernel.moe_experts_kernel() is not None
    fn = cpu_kernels._library("moe_cpu.c").moe_experts
    E, H, I, T, k = 5, 32, 16, 21, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).topk(k, -1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    token, slot_w = order // k, torch.rand(T * k, generator=g)
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = torch.bincount(ids, minlength=E).cumsum(0)
    w13t, w2t = torch.randn(E, H, 2 * I, generator=g), torch.randn(E, I, H, generator=g)
    ptr = [ctypes.c_void_p(t.data_ptr()) for t in (x, token, offsets, slot_w, w13t, w2t)]
    whole, halves = torch.zeros(T, H), torch.zeros(T, H)
    fn(0, T, E, H, I, *ptr, ctypes.c_void_p(whole.data_ptr()))
    for lo, hi in ((0, 9), (9, T)):
        fn(lo, hi, E, H, I, *ptr, ctypes.c_void_p(halves.data_ptr()))
    assert torch.equal(whole, halves) and whole.abs().sum() > 0


@needs_cc
def test_thread_count_does_not_change_results():
    """The kernels split their work over torch's threads themselves (OpenMP): one thread and
    two give bitwise the same recurrence, the same prepared inputs and the same experts."""
    from kdaserve.ops.cpu_kernels import kda_prepare_kernel
    from kdaserve.ops.moe_kernel import moe_experts_kernel

    recur, prep, moe = kda_recurrent_slots_kernel(), kda_prepare_kernel(), moe_experts_kernel()
    assert recur is not None and prep is not None and moe is not None
    g = torch.Generator().manual_seed(3)
    B, L, H, D = 5, 40, 2, 64                       # enough steps to split
    inputs = _inputs(B, L, H, D, seed=11)
    store0 = torch.randn(B, H, D, D, generator=g) * 0.1
    T, W = 3 * 70, 3
    pre, fraw = torch.randn(T, 3 * H * D, generator=g), torch.randn(T, H * D, generator=g)
    braw, window = torch.randn(T, H, generator=g), torch.randn(3, W, 3 * H * D, generator=g)
    cu = torch.tensor([0, 70, 71, T])                # uneven sequences
    conv = torch.randn(W + 1, 3 * H * D, generator=g)
    dt, a = torch.randn(H * D, generator=g), torch.rand(H, generator=g)
    E, Hm, I, S = 6, 32, 16, 300
    x = torch.randn(S, Hm, generator=g)
    ids = torch.rand(S, E, generator=g).topk(2, -1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = torch.bincount(ids, minlength=E).cumsum(0)
    w13t, w2t = torch.randn(E, Hm, 2 * I, generator=g), torch.randn(E, I, Hm, generator=g)
    slot_w = torch.rand(2 * S, generator=g)

    def run() -> list[torch.Tensor]:
        store = store0.clone()
        o = recur(store, torch.arange(B), *inputs)
        prepared = prep(pre, window, cu, conv, fraw, dt, a, braw, H, D ** -0.5)
        out = moe(x, order // 2, offsets, slot_w, w13t, w2t, torch.zeros(S, Hm))
        return [o, store, *prepared, out]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(p, q) for p, q in zip(one, two))
