"""DSpark speculation under TP=2, TP=2 x EP=2 (K3, the released draft layout whose mask is the
target's embedding of a token: gathered from the vocabulary-parallel table) and DP=2 x EP=2:
the same greedy tokens and logprobs as one process with the same draft, and as one process
without speculation. Every rank runs the (small, replicated) draft on the same inputs and
draws the same drafts; under DP each rank drafts for its own requests."""

from __future__ import annotations

import pytest

from kdaserve.engine.llm import LLM
from kdaserve.model.loader import save_model

from k3_models import k3_raw, write_k3_checkpoint, write_random_draft
from test_layouts import GREEDY, HIT, PROMPTS, _assert_same
from tiny_models import random_model, tiny_config


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi_linear")
    save_model(random_model(tiny_config(num_attention_heads=2)), out)
    draft = write_random_draft(tmp_path_factory.mktemp("draft"), 48, 64, (0, 3))
    return str(out), str(draft)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3")
    write_k3_checkpoint(out, k3_raw())
    draft = write_random_draft(tmp_path_factory.mktemp("k3_draft"), 64, 96, (1, 4),
                               k3_layout=True)
    return str(out), str(draft)


def _generate(path: str, draft: str | None, **layout):
    spec = dict(speculative_method="dspark", speculative_model=draft,
                num_speculative_tokens=3, speculative_adaptive=False) if draft else {}
    llm = LLM(path, num_threads=1, max_model_len=256, cache_memory=8 << 20, **spec, **layout)
    try:
        outs = llm.generate(PROMPTS, GREEDY) + llm.generate(HIT, GREEDY)
        drafted = llm.engine.scheduler.num_draft_tokens
    finally:
        llm.shutdown()
    return outs, drafted


@pytest.mark.parametrize("model, layout", [
    ("kimi_linear", {"tensor_parallel_size": 2}),
    ("k3", {"tensor_parallel_size": 2, "expert_parallel_size": 2}),
    ("kimi_linear", {"data_parallel_size": 2, "expert_parallel_size": 2}),
])
def test_dspark_layout_matches_one_process(request, model, layout):
    path, draft = request.getfixturevalue(model)
    plain, _ = _generate(path, None)
    one, drafted_one = _generate(path, draft)
    many, drafted = _generate(path, draft, **layout)
    assert drafted_one > 0 and drafted == drafted_one
    assert many[2].num_cached_tokens >= 32          # the prefix hit happened
    _assert_same(one, many)
    _assert_same(plain, many)
