"""The compiled sampler against the torch form it replaces (kdaserve.engine.sampler): the same
token for the same uniforms, over penalties, temperature, top-k, top-p and min-p, and for
peaked, flat and top-k-bound rows (each takes another path through the nucleus search).
Greedy rows must agree exactly; a sampled row may differ only where its uniform falls within
rounding of a token boundary (the two sum probabilities in different orders), which these
draws never hit."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import needs_kernels, require

from kdaserve.engine.sampler import SamplingRow, _filter, sample
from kdaserve.engine.spec.rejection import target_probs
from kdaserve.ops.sample_kernel import row_probs_kernel, sample_rows_kernel
from kdaserve.request import SamplingParams

pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _built():
    require(sample_rows_kernel(), "csrc/sample_cpu.c")

CASES = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
    dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.2, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3),
    dict(temperature=0.5, top_p=0.5, top_k=3),
    dict(temperature=1.0, top_k=50),                 # top-k bound, top-p off
    dict(temperature=0.9, top_p=0.99, min_p=0.01),
]


def _rows(B: int, V: int, seed: int, **kw) -> list[SamplingRow]:
    g = torch.Generator().manual_seed(seed)
    return [SamplingRow(f"r{i}", SamplingParams(seed=i, **kw),
                        torch.randint(0, V, (30,), generator=g).tolist(),
                        torch.randint(0, V, (60,), generator=g).tolist(),
                        torch.Generator().manual_seed(1000 * seed + i)) for i in range(B)]


@pytest.mark.parametrize("V, scale", [(4096, 3.0), (4096, 12.0), (4096, 0.3), (100, 2.0),
                                      (20000, 1.0), (4096, 60.0)])
def test_compiled_matches_the_torch_form(V, scale):
    """scale 12: peaked rows (the close-token heap); 3 and 1: wider nuclei (the buckets);
    0.3: nearly flat; V 100: a small vocabulary; 60: top-k reached only past the buckets'
    span (ranked from all the tokens)."""
    total = differ = 0
    for c, kw in enumerate(CASES):
        for trial in range(3):
            seed = 100 * c + trial
            logits = torch.randn(8, V, generator=torch.Generator().manual_seed(seed)) * scale
            fast = [t.token_id for t in sample(logits, _rows(8, V, seed, **kw), fast=True)]
            ref = [t.token_id for t in sample(logits, _rows(8, V, seed, **kw), fast=False)]
            if kw["temperature"] == 0:
                assert fast == ref, kw
            total += len(ref)
            differ += sum(a != b for a, b in zip(fast, ref))
    assert differ == 0, f"{differ} of {total} sampled tokens differ"


def test_logprobs_and_bias_rows():
    """Logprobs come from the raw logits on both paths; a row with logit_bias sends the batch
    through the torch form."""
    V = 500
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) * 4
    for kw in (dict(temperature=0.8, logprobs=3), dict(temperature=0.8, logit_bias={7: 100.0})):
        fast = sample(logits, _rows(3, V, 5, **kw), fast=True)
        ref = sample(logits, _rows(3, V, 5, **kw), fast=False)
        assert [t.token_id for t in fast] == [t.token_id for t in ref]
        assert [t.logprob for t in fast] == [t.logprob for t in ref]
    assert all(t.token_id == 7 for t in fast)


def test_top_k_one_and_ties_keep_the_first_best():
    """top_k 1 is greedy; among equal logits the first wins (torch's argmax)."""
    logits = torch.zeros(2, 64)
    logits[0, 5] = logits[0, 9] = 2.0
    logits[1, 40] = 1.0
    rows = _rows(2, 64, 1, temperature=1.0, top_k=1)
    assert [t.token_id for t in sample(logits, rows, fast=True)] == [5, 40]
    rows = _rows(2, 64, 1, temperature=0.0)
    assert [t.token_id for t in sample(logits, rows, fast=True)] == [5, 40]


def test_rows_split_over_threads_sample_the_same_tokens():
    """Rows split over torch's threads (one OpenMP region, each thread a run of rows and its
    own scratch) give each row the token it gets alone and on one thread."""
    V, B = 4096, 32
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(9)) * 3
    kw = CASES[2]                                    # sampled, top-p, a repetition penalty
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = [t.token_id for t in sample(logits, _rows(B, V, 7, **kw))]
        torch.set_num_threads(1)
        one = [t.token_id for t in sample(logits, _rows(B, V, 7, **kw))]
    finally:
        torch.set_num_threads(before)
    alone = [sample(logits[i:i + 1], _rows(B, V, 7, **kw)[i:i + 1])[0].token_id
             for i in range(B)]
    assert split == one == alone


def _probs_torch(x: torch.Tensor, kw: dict) -> torch.Tensor:
    """The torch form, a row at a time (batched, a top-p of 1.0 beside filtered rows drops
    the last ~1e-7 of the mass to float rounding; alone it filters nothing, as the kernel)."""
    params = SamplingParams(**{**kw, "temperature": 1.0})
    return torch.cat([_filter(x[i:i + 1], [SamplingRow("r", params, [], [], None)]).softmax(-1)
                      for i in range(x.shape[0])])


@pytest.mark.parametrize("V, scale", [(4096, 3.0), (4096, 12.0), (4096, 0.3), (100, 2.0),
                                      (4096, 60.0)])
def test_compiled_distributions_match_the_torch_form(V, scale):
    """Speculative decoding's p and q (spec/rejection.py target_probs): the same tokens kept
    (top-k, top-p, min-p, masked ones) and the same probabilities to float rounding; tokens
    over 87 nats under the best weigh 0 (softmax: under 1e-37)."""
    kernel = row_probs_kernel()
    require(kernel, "csrc/sample_cpu.c")
    for c, kw in enumerate(CASES):
        if kw["temperature"] == 0:
            continue
        x = torch.randn(6, V, generator=torch.Generator().manual_seed(c)) * scale
        x[1, : V // 4] = float("-inf")                       # a grammar's mask
        ref = _probs_torch(x, kw)
        got = kernel(x, [kw.get("top_k") or V] * 6, [kw.get("top_p", 1.0)] * 6,
                     [kw.get("min_p", 0.0)] * 6)
        # where one form keeps a token the other drops: only the tail that a top-p of 1.0
        # loses to rounding once the mass sums to the total (in float in the torch form)
        assert float((got * (ref == 0)).sum(-1).max()) < 1e-6, kw
        assert float((ref * (got == 0)).sum(-1).max()) < 1e-6, kw
        if kw.get("top_p", 1.0) < 1.0:
            assert torch.equal(got > 1e-30, ref > 1e-30), kw
        assert bool((got[1, : V // 4] == 0).all())           # the mask
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), kw


def test_compiled_distributions_ignore_their_batch_mates_and_threads():
    V, B = 4096, 24
    x = torch.randn(B, V, generator=torch.Generator().manual_seed(4)) * 3
    kernel = row_probs_kernel()
    require(kernel, "csrc/sample_cpu.c")
    ks, ps, ms = [V] * B, [0.95, 0.5, 1.0] * (B // 3), [0.0, 0.0, 0.05] * (B // 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        split = kernel(x, ks, ps, ms)
        torch.set_num_threads(1)
        one = kernel(x, ks, ps, ms)
    finally:
        torch.set_num_threads(before)
    alone = torch.cat([kernel(x[i:i + 1], ks[i:i + 1], ps[i:i + 1], ms[i:i + 1])
                       for i in range(B)])
    assert torch.equal(split, one) and torch.equal(one, alone)


def test_speculation_uses_the_compiled_distributions():
    """target_probs takes the kernel on CPU and agrees with its torch form."""
    V = 4096
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(8)) * 3
    rows = _rows(4, V, 3, **CASES[2])
    fast, ref = target_probs(x, rows), target_probs(x, rows, fast=False)
    assert torch.equal(fast > 0, ref > 0)
    assert torch.allclose(fast, ref, rtol=1e-5, atol=0)
