"""Device sampling (engine/device_sampling.py, spec/device_rejection.py, readback.py), run on CPU
tensors: the same tokens and logprobs as the torch references (sampler.sample with fast=False,
rejection.verify) for greedy and seeded rows, with every processing step in the batch, and no
tensor read back to Python before the one copy (the sync detector of tests/no_reads.py)."""

from __future__ import annotations

import pytest
import torch
from no_reads import no_reads

from kdaserve import LLM, SamplingParams
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.device_sampling import sample_on_device
from kdaserve.engine.readback import Readback
from kdaserve.engine.row_sampling import PendingSample
from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.engine.spec.device_rejection import verify_on_device
from kdaserve.engine.spec.rejection import VerifyRow, verify
from kdaserve.structured import bitmask as token_bitmask

V = 5000          # past both candidate counts of the reference's top-k/top-p (256, 4096)

PLAIN = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 0.9, "top_p": 0.8, "frequency_penalty": 0.4, "presence_penalty": 0.3},
    {"temperature": 1.2, "min_p": 0.05, "logprobs": 3},
    {"temperature": 0.8, "top_k": 300, "top_p": 0.95, "logit_bias": {11: 6.0, 4999: 3.0}},
    {"temperature": 1.0, "seed": None},
    {"temperature": 0.6, "top_p": 0.999, "repetition_penalty": 0.8},
]


def _rows(seed: int, masked: int | None = None) -> list[SamplingRow]:
    """Each row its own seeded stream, except the unseeded ones, which share one."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.Generator().manual_seed(seed + 1)
    rows = []
    for i, kw in enumerate(PLAIN):
        kw = dict(kw)
        seeded = kw.pop("seed", i) is not None
        gen = torch.Generator().manual_seed(1000 * seed + i) if seeded else shared
        rows.append(SamplingRow(f"r{i}", SamplingParams(**kw),
                                torch.randint(0, V, (30,), generator=g).tolist(),
                                torch.randint(0, V, (12,), generator=g).tolist(), gen))
    if masked is not None:          # a grammar allows only the ids 96..159 and 7
        mask = torch.zeros(token_bitmask.words(V), dtype=torch.int32)
        mask[3:5] = -1
        mask[0] |= 1 << 7
        rows[masked].bitmask = mask
    return rows


def _logits(seed: int, rows: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def _device(draw) -> list:
    """Read a device draw back as PendingSample does (the sync-free part already ran)."""
    return Readback(draw.tensors()).wait()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_rows_match_the_torch_reference(seed):
    masked = seed if seed < len(PLAIN) else None
    logits = _logits(seed, len(PLAIN), scale=[3.0, 8.0, 0.5][seed])
    want = sample(logits, _rows(seed, masked), fast=False)
    rows = _rows(seed, masked)
    with no_reads():
        draw = sample_on_device(logits, rows)
        pending = PendingSample(rows, [], Readback(draw.tensors()))
    got = pending.result()
    assert [got[r.request_id][0] for r in rows] == want          # tokens and logprobs
    if masked is not None:
        assert want[masked].token_id in {7, *range(96, 160)}


def test_seeded_rows_ignore_their_batch_mates():
    logits = _logits(5, len(PLAIN))
    alone = _device(sample_on_device(logits[3:4], _rows(5)[3:4]))[0]
    together = _device(sample_on_device(logits, _rows(5)))[0]
    assert together[3] == alone[0]


def _verify_rows(seed: int, with_q: bool) -> tuple[torch.Tensor, list[VerifyRow]]:
    """Four requests: greedy with 3 drafts, random with 0, 1 and 3 drafts (penalties and
    top-p on some); draft probabilities from a proposer, or point masses."""
    g = torch.Generator().manual_seed(seed)
    specs = [({"temperature": 0.0, "presence_penalty": 0.5, "logprobs": 1}, 3),
             ({"temperature": 1.0}, 0),
             ({"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2}, 1),
             ({"temperature": 1.1, "logprobs": 2, "frequency_penalty": 0.2}, 3)]
    logits = _logits(seed + 50, sum(n + 1 for _, n in specs), scale=1.5)
    # drafts the target likes, so that some are accepted and some not
    rows, at = [], 0
    for i, (kw, n) in enumerate(specs):
        top = logits[at:at + n].topk(3, -1).indices
        drafts = [int(top[j, int(torch.randint(0, 3, (1,), generator=g))]) for j in range(n)]
        q = (torch.softmax(logits[at:at + n] + torch.randn(n, V, generator=g), -1)
             if with_q and n and kw["temperature"] > 0 else None)
        row = SamplingRow(f"v{i}", SamplingParams(**kw),
                          torch.randint(0, V, (9,), generator=g).tolist(),
                          torch.randint(0, V, (5,), generator=g).tolist(),
                          torch.Generator().manual_seed(77 * seed + i))
        rows.append(VerifyRow(row, drafts, q))
        at += n + 1
    return logits, rows


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("seed", range(6))
def test_verify_rows_match_the_rejection_reference(seed, with_q, block):
    """The device form against the host form, token by token or block verification."""
    logits, rows = _verify_rows(seed, with_q)
    for v in rows:
        v.block = block
    want = verify(logits, rows)
    logits, rows = _verify_rows(seed, with_q)
    for v in rows:
        v.block = block
    with no_reads():
        draw = verify_on_device(logits, rows)
        pending = PendingSample([], rows, Readback(draw.tensors()))
    got = pending.result()
    assert [got[v.row.request_id] for v in rows] == want


def test_verify_accepts_and_rejects_over_the_seeds():
    """The cases above reach both outcomes (otherwise they would test little)."""
    lengths = set()
    for seed in range(6):
        for with_q in (True, False):
            logits, rows = _verify_rows(seed, with_q)
            lengths |= {(len(v.drafts), len(t)) for v, t in zip(rows, verify(logits, rows))}
    assert (3, 4) in lengths and (1, 2) in lengths                   # all drafts accepted
    assert any(0 < n and m <= n for n, m in lengths)                  # a draft rejected


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_engine_samples_the_same_tokens_on_the_device_form(monkeypatch, temperature):
    """The whole engine with the device form forced on (CPU tensors) against the host form:
    greedy, and seeded sampling with penalties and top-p."""
    sp = SamplingParams(temperature=temperature, top_p=0.9, seed=4, max_tokens=10,
                        presence_penalty=0.3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3, 11]}]
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("KDASERVE_DEVICE_SAMPLING", mode)
        llm = LLM(kimi_linear_demo_path(), max_num_seqs=4, cache_memory=32 << 20,
                  num_threads=1)
        assert llm.engine.runner.sampler.on_device is (mode == "1")
        res = llm.generate(prompts, sp, use_tqdm=False)
        outs[mode] = [o.outputs[0].token_ids for o in res]
    assert outs["0"] == outs["1"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_nothing_waits_and_the_tokens_are_the_cpu_references():
    """On a GPU: no read-back before the copy, and the same tokens as the CPU references
    (greedy exactly; a random row could differ only where its uniform falls within rounding
    of a CDF boundary, which these cases do not hit)."""
    cuda = torch.device("cuda")
    logits = _logits(0, len(PLAIN))
    want = sample(logits, _rows(0, 2), fast=False)
    rows = _rows(0, 2)
    with no_reads():
        draw = sample_on_device(logits.to(cuda), rows)
        pending = PendingSample(rows, [], Readback(draw.tensors()))
    got = pending.result()
    assert [got[r.request_id][0].token_id for r in rows] == [t.token_id for t in want]
    for with_q in (True, False):
        vl, vrows = _verify_rows(1, with_q)
        want_v = verify(vl, vrows)
        vl, vrows = _verify_rows(1, with_q)
        with no_reads():
            pending = PendingSample([], vrows, Readback(verify_on_device(
                vl.to(cuda), vrows).tensors()))
        assert [[t.token_id for t in got] for got in pending.result().values()] == [
            [t.token_id for t in w] for w in want_v]
