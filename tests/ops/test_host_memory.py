"""freeze_startup_heap (kdaserve/ops/host_memory.py): after an engine starts, what is alive is
moved out of the cyclic collector's reach; a later start thaws and collects first, so an engine
closed before it is not kept (without that, a process that starts engines one after another,
as this suite's does, holds several closed engines' caches: ~3x its peak memory)."""

from __future__ import annotations

import gc
import weakref

import pytest
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.model.loader import save_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def model_dir(tmp_path):
    save_model(random_model(tiny_config(), seed=2), tmp_path)
    return str(tmp_path)


@pytest.fixture
def thawed():
    """Whatever a test froze is collectable again after it."""
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.collect()


def _tokens(llm: LLM) -> list[int]:
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], GREEDY, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_engine_start_freezes_and_a_later_start_frees_the_closed_engine(model_dir, thawed,
                                                                        monkeypatch):
    monkeypatch.setenv("KDASERVE_GC_FREEZE", "0")
    want = _tokens(LLM(model_dir, cache_memory=16 << 20))
    assert gc.get_freeze_count() == 0                   # opted out: nothing frozen
    monkeypatch.setenv("KDASERVE_GC_FREEZE", "1")
    first = LLM(model_dir, cache_memory=16 << 20)
    assert gc.get_freeze_count() > 0
    assert _tokens(first) == want                       # a frozen heap computes the same
    model = weakref.ref(first.engine.model)
    del first
    second = LLM(model_dir, cache_memory=16 << 20)      # thaws and collects, then freezes
    assert model() is None, "the closed engine was kept by the freeze"
    assert gc.get_freeze_count() > 0 and _tokens(second) == want
