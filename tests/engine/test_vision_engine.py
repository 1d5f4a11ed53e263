"""Images through the engine: encoder cache, placeholder scatter across chunk boundaries,
image-aware prefix-cache keys; greedy output against transformers' Kimi K2.5."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kdaserve.cache.prefix_cache import block_hashes
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams
from hf_vision_reference import IMAGE_TOKEN, make_hf_k25_checkpoint

pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    path = tmp_path_factory.mktemp("k25engine")
    return path, make_hf_k25_checkpoint(path, seed=3)


def picture(h, w, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def llm_for(path, **kw):
    return LLM(str(path), block_size=4, max_model_len=256, **kw)


def prompt(text_a, text_b, *images):
    """token ids: text, one placeholder per image (expanded by the engine's input side)."""
    ids = list(text_a)
    for _ in images:
        ids.append(IMAGE_TOKEN)
    return {"prompt_token_ids": ids + list(text_b),
            "multi_modal_data": {"image": list(images)}}


A, B = [5, 9, 14, 3, 22, 7, 31, 8, 11], [40, 41, 42]


def test_greedy_matches_transformers_through_the_engine(k25):
    path, hf = k25
    img1, img2 = picture(60, 90, 1), picture(84, 84, 2)
    llm = llm_for(path, enable_prefix_caching=False)
    out = llm.generate([prompt(A, B, img1), prompt(A, B, img1, img2)], GREEDY, use_tqdm=False)
    from kdaserve.model.vision.processor import preprocess
    for o, imgs in zip(out, ([img1], [img1, img2])):
        pp = [preprocess(i) for i in imgs]
        pix = torch.from_numpy(np.concatenate([p.pixels for p in pp]))
        thw = torch.tensor([[1, *p.grid] for p in pp])
        ids = torch.tensor([o.prompt_token_ids])
        assert (ids == IMAGE_TOKEN).sum().item() == sum(p.num_tokens for p in pp)
        with torch.no_grad():
            ref = hf.generate(ids, pixel_values=pix, image_grid_thw=thw, max_new_tokens=8,
                              do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == ref


def two_images():
    return prompt(A, B, picture(60, 90, 1), picture(84, 84, 2))


@pytest.fixture(scope="module")
def whole(k25):
    """The two-image prompt's greedy tokens prefilled in one chunk (built once: the reference
    of every chunked run)."""
    path, _ = k25
    out = llm_for(path, enable_prefix_caching=False).generate(two_images(), GREEDY,
                                                              use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("budget", [5, 7, 16])
def test_chunk_boundary_inside_an_image(k25, whole, budget):
    """Prefill chunks of 5 / 7 / 16 tokens split the 12-token placeholder run of the first
    image (and the 9 of the second) at different places: the same greedy tokens as one chunk."""
    path, _ = k25
    llm = llm_for(path, enable_prefix_caching=False, max_num_batched_tokens=budget,
                  long_prefill_token_threshold=budget)
    chunked = llm.generate(two_images(), GREEDY, use_tqdm=False)
    assert chunked[0].outputs[0].token_ids == whole
    assert llm.engine.runner.encoder_cache.num_encoded == 2


def test_same_image_hits_the_encoder_cache(k25):
    path, _ = k25
    llm = llm_for(path, enable_prefix_caching=False)
    img = picture(60, 90, 1)
    first = llm.generate(prompt(A, B, img), GREEDY, use_tqdm=False)
    again = llm.generate(prompt([6, 6], B, img.copy()), GREEDY, use_tqdm=False)
    cache = llm.engine.runner.encoder_cache
    assert cache.num_encoded == 1 and cache.num_hits >= 1
    llm.generate(prompt(A, B, picture(60, 90, 5)), GREEDY, use_tqdm=False)
    assert cache.num_encoded == 2
    assert first[0].outputs[0].token_ids and again[0].outputs[0].token_ids


def test_prefix_cache_keys_include_each_image_at_its_position(k25):
    path, _ = k25
    llm = llm_for(path, state_snapshot_interval=8)   # KDA snapshots every 2 blocks: hits there
    img1, img2 = picture(60, 90, 1), picture(60, 90, 2)
    text = A + A + A              # 27 tokens of text before the image: 6 full blocks of 4
    _, ids1, m1 = llm._prompt_media(prompt(text, B, img1))
    _, ids2, m2 = llm._prompt_media(prompt(text, B, img2))
    assert ids1 == ids2 and m1[0].hash != m2[0].hash
    h1 = block_hashes(ids1, 4, tuple(m.placed_key() for m in m1))
    h2 = block_hashes(ids2, 4, tuple(m.placed_key() for m in m2))
    # blocks wholly before the image (offset 27: blocks 0..5) are shared, the rest differ
    assert h1[:6] == h2[:6] and all(a != b for a, b in zip(h1[6:], h2[6:]))

    ref = llm_for(path, enable_prefix_caching=False).generate(
        prompt(text, B, img2), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate(prompt(text, B, img1), GREEDY, use_tqdm=False)
    out = llm.generate(prompt(text, B, img2), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref             # no false hit on img1's blocks
    assert out.num_cached_tokens == 24                 # the text before the image was reused
    same = llm.generate(prompt(text, B, img2), GREEDY, use_tqdm=False)[0]
    assert same.num_cached_tokens > 27 and same.outputs[0].token_ids == ref


def test_bad_media_is_refused(k25):
    path, _ = k25
    llm = llm_for(path)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(prompt(A + [IMAGE_TOKEN], B, picture(60, 90, 1)), GREEDY, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": A}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
