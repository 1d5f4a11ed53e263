"""Prefix caching changes nothing but the work done: outputs are token-identical to caching off."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def shared_prefix_prompts(vocab: int, n: int = 24, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    roots = [torch.randint(3, vocab, (int(torch.randint(5, 70, (1,), generator=g)),),
                           generator=g).tolist() for _ in range(3)]
    prompts = []
    for i in range(n):
        root = roots[i % 3]
        cut = int(torch.randint(1, len(root) + 1, (1,), generator=g))
        tail = torch.randint(3, vocab, (int(torch.randint(0, 20, (1,), generator=g)),),
                             generator=g).tolist()
        prompts.append(root[:cut] + tail if tail or cut else root)
    return prompts


def generate(llm: LLM, prompts, waves: int = 3):
    """Submit in waves so later waves find what earlier ones cached."""
    out = []
    size = -(-len(prompts) // waves)
    for i in range(0, len(prompts), size):
        res = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + size]], GREEDY,
                           use_tqdm=False)
        out += [r.outputs[0].token_ids for r in res]
    assert llm.engine.cache.block_pool.num_free == llm.engine.cache.block_pool.num_blocks
    assert llm.engine.cache.state_pool.num_free == llm.engine.cache.state_pool.num_slots
    return out


@pytest.fixture(scope="module")
def prompts(hf_checkpoint):
    return shared_prefix_prompts(hf_checkpoint[1].config.vocab_size)


@pytest.fixture(scope="module")
def uncached(hf_checkpoint, prompts):
    return generate(LLM(str(hf_checkpoint[0]), enable_prefix_caching=False, block_size=4), prompts)


def test_identical_with_prefix_caching(hf_checkpoint, prompts, uncached):
    llm = LLM(str(hf_checkpoint[0]), block_size=4, state_snapshot_interval=8)
    assert generate(llm, prompts) == uncached
    st = llm.engine.cache.stats
    assert st.hits > 0 and st.hit_tokens > 0 and st.snapshots_taken > 0


def test_identical_under_constant_eviction_and_preemption(hf_checkpoint, prompts, uncached):
    snap = LLM(str(hf_checkpoint[0]), block_size=4).engine.cache.snapshots.snapshot_bytes
    llm = LLM(str(hf_checkpoint[0]), block_size=4, num_blocks=30, state_snapshot_interval=8,
              state_snapshot_budget=3 * snap, max_num_batched_tokens=48)
    assert generate(llm, prompts, waves=2) == uncached
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.cache.snapshots.evictions > 0


def test_two_turn_chat_computes_only_new_tokens(hf_checkpoint):
    llm = LLM(str(hf_checkpoint[0]), block_size=4)
    g = torch.Generator().manual_seed(3)
    turn1 = torch.randint(3, 90, (23,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out1 = llm.generate([{"prompt_token_ids": turn1}], sp, use_tqdm=False)[0]
    turn2 = turn1 + out1.outputs[0].token_ids + torch.randint(3, 90, (9,), generator=g).tolist()
    before = llm.engine.runner.num_forward_tokens
    out2 = llm.generate([{"prompt_token_ids": turn2}], sp, use_tqdm=False)[0]
    computed = llm.engine.runner.num_forward_tokens - before
    # turn 1 computed 23 + 4 tokens (its last answer token is never fed back): the latest
    # block boundary it passed is 24, past the prompt's last full block (20): policy 4 hits
    assert out2.num_cached_tokens == 24
    assert computed == len(turn2) - 24 + (sp.max_tokens - 1)
    ref = LLM(str(hf_checkpoint[0]), enable_prefix_caching=False)
    assert ref.generate([{"prompt_token_ids": turn2}], sp, use_tqdm=False)[0].outputs[0].token_ids \
        == out2.outputs[0].token_ids


def test_other_image_or_salt_never_hits(hf_checkpoint):
    llm = LLM(str(hf_checkpoint[0]), block_size=4)
    eng = llm.engine
    prompt = list(range(3, 40))
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for rid, keys, salt in (("a", ("img:1",), None), ("b", ("img:2",), None),
                            ("c", ("img:1",), "tenant-x"), ("d", ("img:1",), None)):
        eng.add_request(rid, prompt, sp, extra_keys=keys, cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
    st = eng.cache.stats
    assert st.queries == 4 and st.hits == 1   # only "d" (same image, no salt) hits "a"
