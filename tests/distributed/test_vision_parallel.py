"""Images under TP=2, EP=2 and PP=2 (2 gloo processes): every rank runs the (replicated)
vision tower, scatters the image rows into its embeddings (gathered from the vocabulary-parallel
table under TP; under PP the first stage alone embeds), and the greedy tokens and prefix hits
equal one process's."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams

pytest.importorskip("transformers")
from hf_vision_reference import IMAGE_TOKEN, make_hf_k25_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    path = tmp_path_factory.mktemp("k25tp")
    make_hf_k25_checkpoint(path, seed=3)
    return str(path)


def _prompt(*images):
    rng = [np.random.default_rng(s) for s in range(len(images))]
    pics = [Image.fromarray(r.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for r, (h, w) in zip(rng, images)]
    ids = [5, 9, 14, 3, 22, 7, 31, 8, 11] + [IMAGE_TOKEN] * len(pics) + [40, 41, 42]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": pics}}


def _generate(path: str, **layout):
    llm = LLM(path, block_size=4, max_model_len=256, num_threads=1, cache_memory=8 << 20,
              **layout)
    try:
        prompts = [_prompt((60, 90)), _prompt((60, 90), (84, 84))]
        return llm.generate(prompts, GREEDY) + llm.generate(prompts[1:], GREEDY)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"expert_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}])
def test_images_under_layout_match_one_process(k25, layout):
    one = _generate(k25)
    many = _generate(k25, **layout)
    assert many[2].num_cached_tokens > 0            # the repeated image prompt hit the cache
    for a, b in zip(one, many):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
