"""A tiny random Kimi Linear decodes greedily through the Triton kernels (KDA decode on the
slots, paged MLA decode) the same tokens as through the CPU path: the model's dispatch reaches
the kernels (kdaserve.ops.gpu.kernels_for: on CUDA, and on CPU under the interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve.model.batch import build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.ops import gpu, registry
from kdaserve.ops.gpu import kda_decode, mla_decode

pytestmark = pytest.mark.gpu

BS = 4


def _greedy(model, prompts: list[list[int]], steps: int, device: torch.device
            ) -> tuple[list[list[int]], list]:
    """Prefill every prompt in one step, then `steps` batched one-token decode steps, each
    sequence in its own slot and blocks (shuffled in the pool). Returns tokens and logits."""
    cfg = model.config
    n = len(prompts)
    per = -(-(max(map(len, prompts)) + steps) // BS)
    cache = HybridCache.allocate(cfg, n * per + 2, BS, n + 2, device=device)
    perm = torch.randperm(n * per, generator=torch.Generator().manual_seed(0)) + 1
    tables = perm.view(n, per).tolist()
    slots = [n - i for i in range(n)]
    seqs = [list(p) for p in prompts]
    ctx = [0] * n
    chunks = [list(p) for p in prompts]
    logits_seen = []
    for step in range(steps + 1):
        lens = [len(c) for c in chunks]
        fb = build_forward_batch(
            lens, ctx, num_decode=n if step else 0, conv_kernel=cfg.conv_kernel_size,
            chunk_size=model.chunk_size, cache=cache, block_tables=tables, state_slots=slots,
            logits_indices=torch.tensor(lens).cumsum(0) - 1, device=device)
        ids = torch.tensor([t for c in chunks for t in c], device=device)
        with torch.no_grad():
            logits, _ = model(ids, fb)
        logits_seen.append(logits.cpu())
        nxt = logits.argmax(-1).tolist()
        for i in range(n):
            ctx[i] += lens[i]
            seqs[i].append(nxt[i])
        chunks = [[t] for t in nxt]
    return [s[len(p):] for s, p in zip(seqs, prompts)], logits_seen


@pytest.fixture
def one_thread():
    """torch's worker threads spin against the interpreter's own (several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_greedy_tokens_through_the_kernels_equal_the_cpu_path(monkeypatch, one_thread, device):
    assert gpu.kernels_for(device.type)
    # head dim 16: what fla's chunked prefill takes on CUDA
    cfg = tiny_config(linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3],
                                          "num_heads": 2, "head_dim": 16,
                                          "short_conv_kernel_size": 4})
    model = random_model(cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 64, (m,), generator=g).tolist() for m in (5, 11, 14)]
    steps = 6

    calls = {"kda": 0, "mla": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(kda_decode, "kda_recurrent_slots_triton",
                        spy("kda", kda_decode.kda_recurrent_slots_triton))
    monkeypatch.setattr(mla_decode, "mla_decode_split_k_triton",
                        spy("mla", mla_decode.mla_decode_split_k_triton))
    cached = (registry._interpreted_ops, registry._cuda_ops)   # built with the spy
    for c in cached:
        c.cache_clear()
    try:
        got, got_logits = _greedy(copy.deepcopy(model).to(device), prompts, steps, device)
    finally:
        for c in cached:
            c.cache_clear()
    assert calls["kda"] == steps * len(cfg.kda_layers)
    assert calls["mla"] == steps * len(cfg.mla_layers)

    monkeypatch.setattr(gpu, "kernels_for", lambda device_type: False)
    want, want_logits = _greedy(model, prompts, steps, torch.device("cpu"))
    assert calls["kda"] == steps * len(cfg.kda_layers)      # the CPU path took none of them
    assert got == want
    # on CUDA fla's prefill multiplies fp32 in TF32
    tol = 1e-4 if device.type == "cpu" else 2e-2
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
