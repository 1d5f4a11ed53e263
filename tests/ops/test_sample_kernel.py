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

from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.ops.sample_kernel import sample_rows_kernel
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
