"""TP / EP layouts (2 gloo processes on CPU) against one process: the same greedy tokens and
logprobs within a tight tolerance, on a tiny random Kimi Linear and a tiny random K3, with a
prefix hit and n-gram speculation in the same run. Each layout spawns 2 workers (seconds)."""

from __future__ import annotations

import pytest

from kdaserve.config import ConfigError
from kdaserve.engine.llm import LLM
from kdaserve.model.loader import save_model
from kdaserve.request import SamplingParams

from k3_models import k3_raw, write_k3_checkpoint
from tiny_models import random_model, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
LOOP = [3, 4, 5, 6, 7, 8, 9, 10] * 5       # repeats: n-gram drafts get accepted
PROMPTS = [{"prompt_token_ids": LOOP}, {"prompt_token_ids": [11, 12, 13, 3, 4, 5, 6, 7, 8]}]
HIT = [{"prompt_token_ids": LOOP + [20, 21]}]  # shares 32 tokens (2 blocks) with the first


def _checkpoint(tmp_path_factory, kind: str):
    out = tmp_path_factory.mktemp(kind)
    if kind == "kimi_linear":
        save_model(random_model(tiny_config(num_attention_heads=2)), out)
    else:
        write_k3_checkpoint(out, k3_raw())
    return str(out)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "kimi_linear")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "k3")


def _generate(path: str, **layout):
    llm = LLM(path, num_threads=1, max_model_len=256, cache_memory=8 << 20,
              speculative_method="ngram", num_speculative_tokens=3,
              speculative_adaptive=False, **layout)
    try:
        outs = llm.generate(PROMPTS, GREEDY) + llm.generate(HIT, GREEDY)
    finally:
        llm.shutdown()
    return outs


def _assert_same(one, many) -> None:
    for a, b in zip(one, many):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
        for i, (lx, ly) in enumerate(zip(x.logprobs, y.logprobs)):
            for tok, lp in lx.items():
                assert abs(lp - ly[tok]) < 1e-4, (i, tok)


@pytest.mark.parametrize("model, layout", [
    ("kimi_linear", {"tensor_parallel_size": 2}),                       # MoE tp_sharded
    ("k3", {"tensor_parallel_size": 2, "expert_parallel_size": 2}),     # MoE ep_all2all
    ("kimi_linear", {"expert_parallel_size": 2}),                       # replicated attention
])
def test_layout_matches_one_process(request, model, layout):
    path = request.getfixturevalue(model)
    one = _generate(path)
    many = _generate(path, **layout)
    assert one[2].num_cached_tokens >= 32          # the prefix hit happened
    _assert_same(one, many)


@pytest.mark.parametrize("layout, match", [
    ({"tensor_parallel_size": 3}, "does not divide the model's KDA heads"),
    ({"tensor_parallel_size": 64}, "needs 64 ranks but this machine has"),
    ({"expert_parallel_size": 4}, "does not divide the model's routed experts"),
    ({"tensor_parallel_size": 2, "expert_parallel_size": 4}, "must be 1 or equal"),
    ({"tensor_parallel_size": 2, "moe_backend": "grouped"}, "runs every expert on one rank"),
])
def test_bad_layout_refused_at_startup(kimi_linear, layout, match, monkeypatch):
    if layout.get("tensor_parallel_size") != 64:        # the rank count is not the point
        monkeypatch.setattr("kdaserve.distributed.layout.available_ranks", lambda _d: 16)
    with pytest.raises(ConfigError, match=match):
        LLM(kimi_linear, num_threads=1, **layout)
