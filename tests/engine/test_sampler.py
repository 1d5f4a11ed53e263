from __future__ import annotations

import pytest
import torch

from kdaserve import LLM
from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.request import SamplingParams, SamplingParamsError


def row(rid="r", gen=None, prompt=(1,), out=(), **kw):
    return SamplingRow(rid, SamplingParams(**kw), list(prompt), list(out), gen)


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    toks = sample(logits, [row(temperature=0.0, logprobs=2), row(temperature=0.0)])
    assert [t.token_id for t in toks] == [1, 0]
    lp = logits.log_softmax(-1)
    assert toks[0].logprob == pytest.approx(lp[0, 1].item())
    assert list(toks[0].top_logprobs) == [1, 2]
    assert toks[1].top_logprobs is None


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    for kw, allowed in (({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}),
                        ({"min_p": 0.3}, {0, 1})):
        g = torch.Generator().manual_seed(0)
        toks = sample(logits, [row(gen=g, temperature=1.0, **kw) for _ in range(200)])
        assert {t.token_id for t in toks} == allowed, kw


def test_seeded_rows_ignore_batch_mates():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    alone = sample(logits[2:3], [row(gen=torch.Generator().manual_seed(9), temperature=1.0)])
    mixed = sample(logits, [row(gen=torch.Generator().manual_seed(s), temperature=1.0)
                            for s in (1, 2, 9, 3)])
    assert mixed[2].token_id == alone[0].token_id


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, [row(temperature=0.0, out=[0], presence_penalty=0.5)])[0].token_id == 1
    assert sample(logits,
                  [row(temperature=0.0, out=[0, 0], frequency_penalty=0.1)])[0].token_id == 1
    assert sample(logits,
                  [row(temperature=0.0, prompt=[0], repetition_penalty=1.2)])[0].token_id == 1


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0},
                                {"top_k": -5}, {"n": 0}, {"logprobs": 50}])
def test_invalid_params_are_named(kw):
    with pytest.raises(SamplingParamsError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_seeded_generation_reproducible_across_batches(hf_checkpoint):
    path, _ = hf_checkpoint
    llm = LLM(str(path))
    target = {"prompt_token_ids": [5, 6, 7, 8]}
    sp = SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 2, 30)]
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 2 + [sp]
                         + [SamplingParams(temperature=0.7, max_tokens=5)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    assert llm.engine.cache.all_free()


def _top_k_top_p_by_full_sort(logits, top_k, top_p):
    """The reference: sort the whole vocabulary."""
    V = logits.shape[-1]
    vals, order = logits.sort(-1, descending=True)
    drop = torch.arange(V)[None] >= top_k[:, None]
    probs = vals.softmax(-1)
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, order, vals.masked_fill(
        drop, float("-inf")))


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])     # flat rows need the full sort
def test_top_k_top_p_matches_a_full_sort(scale):
    from kdaserve.engine.sampler import _top_k_top_p

    g = torch.Generator().manual_seed(int(scale * 10))
    V = 2000
    logits = torch.randn(6, V, generator=g) * scale
    top_k = torch.tensor([V, 40, V, 300, 5, V])
    top_p = torch.tensor([0.95, 1.0, 0.5, 0.9, 0.99, 0.999])
    got = _top_k_top_p(logits, top_k, top_p)
    want = _top_k_top_p_by_full_sort(logits, top_k, top_p)
    # a token whose mass-above sits within rounding of top_p may go either way
    probs = logits.softmax(-1)
    above = (probs[:, None, :] > probs[:, :, None]).float() @ probs[:, :, None]
    edge = (above[..., 0] - top_p[:, None]).abs() < 1e-5
    differ = torch.isfinite(got) != torch.isfinite(want)
    assert not (differ & ~edge).any()
    same = torch.isfinite(got) & torch.isfinite(want)
    assert torch.equal(got[same], want[same])


@pytest.mark.parametrize("fast", [True, False])         # the compiled sampler, the torch form
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_tokens_follow_the_processed_distribution(temperature, top_p, fast):
    """Chi-square over 20,000 draws: sample() draws from softmax(filter(logits / T)), zero-mass
    tokens never."""
    from kdaserve.engine.sampler import _filter

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 12, generator=g) * 1.5
    params = SamplingParams(temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(11)
    row = SamplingRow("r", params, [1], [], gen)
    want = _filter(logits / temperature, [row]).softmax(-1)[0]
    n = 20_000
    counts = torch.zeros(12)
    for _ in range(n // 100):
        toks = sample(logits.expand(100, -1), [row] * 100, fast=fast)
        for t in toks:
            counts[t.token_id] += 1
    assert counts[want == 0].sum() == 0
    keep = want > 0
    exp = want[keep].double() * n
    stat = float(((counts[keep].double() - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    # p-value of the chi-square statistic: the regularised upper incomplete gamma (no scipy)
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))
    assert pvalue > 1e-3, (stat, df)


def test_argmax_rows_shortcut_equals_the_full_sampler():
    """RowSampler takes plain greedy rows as an argmax (RunnerRequest.argmax_only); its
    tokens equal sample()'s, and a row that asks for more (logprobs, a penalty, a bias, a
    temperature) sends the whole step through the full path."""
    from kdaserve.engine.row_sampling import RowSampler
    from kdaserve.engine.step_message import RunnerRequest
    from kdaserve.outputs import ScheduledSequence

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0       # a tie: the lower id, both ways
    kinds = [{"temperature": 0.0}, {"temperature": 0.0, "logprobs": 2},
             {"temperature": 0.0, "repetition_penalty": 1.3},
             {"temperature": 0.0, "logit_bias": {3: 5.0}}]
    for extra in [None] + kinds[1:]:
        params = [SamplingParams(**kinds[0]) for _ in range(4)]
        if extra is not None:
            params[1] = SamplingParams(**extra)
        reqs = {f"r{i}": RunnerRequest(f"r{i}", [1, 2, 3], p, [4]) for i, p in enumerate(params)}
        seqs = [ScheduledSequence(f"r{i}", [4], 4, [0], i, True) for i in range(4)]
        got = RowSampler(0).sample(seqs, logits, reqs)
        want = sample(logits, [row(f"r{i}", prompt=(1, 2, 3), out=(4,), **vars(p))
                               for i, p in enumerate(params)], fast=False)
        assert [got[f"r{i}"][0].token_id for i in range(4)] == [t.token_id for t in want]
        assert all(reqs[f"r{i}"].argmax_only == (i != 1 or extra is None) for i in range(4))
        assert (got["r1"][0].logprob is not None) == (extra is kinds[1])
