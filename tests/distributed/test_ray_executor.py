"""The Ray executor on a local Ray cluster of 2 CPUs: TP=2 and EP=2 through Ray actors give
the same greedy tokens (and logprobs within a tight tolerance) as one process, with a prefix
hit and n-gram speculation; a killed actor ends the engine with a clear error, not a hang,
and the cluster gets its CPUs back. Skipped where Ray is not installed."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from k3_models import k3_raw, write_k3_checkpoint
from test_layouts import _assert_same
from tiny_models import random_model, tiny_config

from kdaserve.engine.executor import ExecutorError
from kdaserve.engine.llm import LLM
from kdaserve.model.loader import save_model
from kdaserve.request import SamplingParams

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
LOOP = [3, 4, 5, 6, 7, 8, 9, 10] * 5
PROMPTS = [{"prompt_token_ids": LOOP}, {"prompt_token_ids": [11, 12, 13, 3, 4, 5, 6, 7, 8]}]
HIT = [{"prompt_token_ids": LOOP + [20, 21]}]      # shares 2 blocks with the first


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of 2 CPUs, Ray's own startup kept small; its actors import this
    checkout's kdaserve."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    out = tmp_path_factory.mktemp("kl")
    save_model(random_model(tiny_config(num_attention_heads=2)), out)
    return str(out)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3")
    write_k3_checkpoint(out, k3_raw())
    return str(out)


def _llm(path: str, **layout) -> LLM:
    return LLM(path, num_threads=1, max_model_len=256, cache_memory=8 << 20,
               speculative_method="ngram", num_speculative_tokens=3,
               speculative_adaptive=False, **layout)


def _generate(path: str, **layout):
    llm = _llm(path, **layout)
    try:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False) + \
            llm.generate(HIT, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def _cpus_back(want: float, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == want:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("model, layout", [
    ("kimi_linear", {"tensor_parallel_size": 2}),
    ("k3", {"tensor_parallel_size": 2, "expert_parallel_size": 2}),
])
def test_ray_matches_one_process(request, cluster, model, layout):
    path = request.getfixturevalue(model)
    one = _generate(path)
    many = _generate(path, distributed_executor="ray", **layout)
    assert one[2].num_cached_tokens >= 32          # the prefix hit happened
    _assert_same(one, many)
    assert _cpus_back(2), "the actors or the placement group outlived shutdown"


def test_killed_actor_ends_engine_with_error(cluster, kimi_linear):
    llm = _llm(kimi_linear, tensor_parallel_size=2, distributed_executor="ray")
    eng = llm.engine
    eng.add_request("a", [3, 4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(3):
        eng.step()
    ray.kill(eng.executor.actors[1], no_restart=True)
    with pytest.raises(ExecutorError, match="the Ray actor of rank 1 died"):
        for _ in range(400):         # bounded: the error comes within the worker timeout
            eng.step()
    assert _cpus_back(2), "the actors or the placement group outlived the failure"
    with pytest.raises(ExecutorError, match="shut down"):
        eng.step()
