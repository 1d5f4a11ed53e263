"""The served engine's thread count follows the cores other processes leave
(engine/cpu_share.py): the decision from measured use, the measurement from /proc counters
(faked here, so no clock or load is needed), and the real counters read on Linux."""

from __future__ import annotations

import sys

import pytest

from kdaserve.engine import cpu_share
from kdaserve.engine.cpu_share import CpuShare


@pytest.mark.parametrize("others, want", [
    (0.0, 2), (0.3, 2), (0.49, 2),      # the HTTP front end's bursts: both cores
    (0.6, 1), (0.67, 1), (1.0, 1),      # a busy loop beside the engine: one core left
    (1.9, 1),                           # never fewer than one
])
def test_two_cores_leave_the_engine_what_others_do_not_use(others, want):
    share = CpuShare(2, cpus={0, 1})
    assert share.decide(others) == want


def test_never_more_threads_than_configured():
    share = CpuShare(4, cpus=set(range(16)))
    assert share.decide(0.0) == 4
    assert share.decide(11.0) == 4      # 5 cores left
    assert share.decide(13.2) == 3
    assert share.decide(15.5) == 1


def test_threads_follow_the_counters(monkeypatch):
    """Others' use is the machine's busy ticks less this process's, per second between two
    readings `interval` apart; the count holds between readings."""
    ticks = {"busy": 0, "own": 0}
    monkeypatch.setattr(cpu_share, "_busy_ticks", lambda cpus: ticks["busy"])
    monkeypatch.setattr(cpu_share, "_own_ticks", lambda: ticks["own"])
    share = CpuShare(2, cpus={0, 1})
    hz = cpu_share._HZ
    assert share.threads(now=0.0) == 2              # the first reading only sets the origin
    ticks["busy"] += 2 * hz // 2                    # 0.5 s: both cores busy ...
    ticks["own"] += hz // 2                         # ... one of them by the engine
    assert share.threads(now=0.2) == 2              # within the interval: unchanged
    assert share.threads(now=0.5) == 1
    assert share.others == pytest.approx(1.0)
    ticks["busy"] += 2 * hz // 2                    # the other process stopped: all ours
    ticks["own"] += 2 * hz // 2
    assert share.threads(now=1.0) == 2
    assert share.others == pytest.approx(0.0)


def test_one_configured_thread_reads_nothing(monkeypatch):
    def fail(*a):
        raise AssertionError("read /proc")
    monkeypatch.setattr(cpu_share, "_busy_ticks", fail)
    assert CpuShare(1, cpus={0, 1}).threads(now=5.0) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_real_counters_read():
    share = CpuShare(2)
    assert share.threads(now=0.0) == 2
    assert 1 <= share.threads(now=1.0) <= 2
    assert share.others >= 0.0


def test_tokens_do_not_depend_on_the_thread_count_between_steps():
    """Greedy tokens with the forward's threads changed at every step (as the engine loop
    does when other processes come and go) equal those of a fixed count, for a batch that
    prefills, decodes and prefills a long prompt beside it."""
    import torch

    from kdaserve import LLM, SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(max_num_seqs=4, cache_memory=64 << 20, max_model_len=512, block_size=16,
                  num_scheduler_steps=1)
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        prompts = [torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(n))
                   .tolist() for n in (5, 23, 300)]
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

        def run(switch: bool) -> dict[str, list[int]]:
            got: dict[str, list[int]] = {}
            for i, p in enumerate(prompts):
                engine.add_request(f"{switch}{i}", p, sp)
            k = 0
            while engine.has_unfinished():
                if switch:
                    engine.runner.set_threads(1 + k % 2)
                    k += 1
                for d in engine.step():
                    got.setdefault(d.request_id[-1], []).extend(d.new_token_ids)
            engine.runner.set_threads(2)
            return got

        llm.engine.flush_cache(drop_device=True)
        want = run(False)
        llm.engine.flush_cache(drop_device=True)
        assert run(True) == want
    finally:
        torch.set_num_threads(old)
