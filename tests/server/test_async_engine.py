"""AsyncEngine on its own: the engine core in a child process, driven from an event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil

import pytest

from kdaserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kdaserve.engine.async_engine import AsyncEngine
from kdaserve.engine.engine_errors import EngineError, EngineStartupError, QueueFullError
from kdaserve.request import SamplingParams

STATS_KEYS = {"num_running", "num_waiting", "cache_usage", "num_free_blocks", "num_free_slots",
              "num_blocks", "all_free", "prefix_cache_queries", "prefix_cache_hits",
              "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "state_snapshots",
              "state_snapshot_bytes", "prompt_tokens",
              "generation_tokens", "preemptions", "steps", "spec_verifications",
              "spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_lengths",
              "spec_accepted_by_position", "spec_draft_seconds", "spec_verify_seconds",
              "spec_dormant_seconds", "spec_adaptive", "offload", "kv_transfer"}


@contextlib.contextmanager
def one_omp_thread():
    """The spawned engine reads OMP_NUM_THREADS when it starts (see server_harness)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old


def config(model_dir, max_num_seqs: int = 1) -> EngineConfig:
    return EngineConfig(model=str(model_dir), cache=CacheConfig(cache_memory_bytes=16 << 20),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=1024))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loop):
    """One sequence at a time, so later requests wait behind a running one."""
    eng = AsyncEngine(config(tiny_model_dir), max_waiting=3)
    with one_omp_thread():
        loop.run_until_complete(eng.start())
    yield eng
    loop.run_until_complete(eng.shutdown())


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 60))


async def collect(engine, rid, ids, params):
    return [d async for d in engine.generate(rid, ids, params)]


async def wait_all_free(engine) -> dict:
    while True:
        stats = await engine.stats()
        if stats["all_free"] and not stats["num_running"] and not stats["num_waiting"]:
            return stats
        await asyncio.sleep(0.02)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_generate_n2_deltas(engine, loop):
    deltas = run(loop, collect(engine, "two", [5, 6, 7], greedy(4, n=2)))
    for i in (0, 1):
        mine = [d for d in deltas if d.index == i]
        assert sum(len(d.new_token_ids) for d in mine) == 4
        assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == "length"
        assert mine[-1].num_prompt_tokens == 3
    assert {d.request_id for d in deltas} == {"two"}
    first = [t for d in deltas if d.index == 0 for t in d.new_token_ids]
    second = [t for d in deltas if d.index == 1 for t in d.new_token_ids]
    assert first == second                       # greedy: both completions agree


def test_stats_keys(engine, loop):
    stats = run(loop, wait_all_free(engine))
    assert set(stats) == STATS_KEYS
    assert stats["num_free_slots"] == 1
    assert stats["num_free_blocks"] == stats["num_blocks"] > 0
    assert stats["cache_usage"] == 0.0


@pytest.mark.parametrize("ids,message", [([10**6], r"prompt token ids must be in \[0, "),
                                         ([], "at least one prompt token"),
                                         ([7] * 1030, "max_model_len is 1024")])
def test_input_error_is_value_error_and_engine_lives(engine, loop, ids, message):
    with pytest.raises(ValueError, match=message):
        run(loop, collect(engine, f"bad-{len(ids)}", ids, greedy(2)))
    assert engine.is_alive
    deltas = run(loop, collect(engine, f"after-bad-{len(ids)}", [5, 6], greedy(2)))
    assert sum(len(d.new_token_ids) for d in deltas) == 2


def test_duplicate_id_is_value_error(engine, loop):
    async def scenario():
        gen = engine.generate("dup", [5, 6], greedy(500))
        await gen.__anext__()
        try:
            with pytest.raises(ValueError, match="duplicate request id"):
                await collect(engine, "dup", [5], greedy(1))
        finally:
            await gen.aclose()

    run(loop, scenario())
    run(loop, wait_all_free(engine))


def test_leaving_early_aborts_and_frees(engine, loop):
    async def scenario():
        gen = engine.generate("leave", [5, 6, 7], greedy(900))
        await gen.__anext__()
        await gen.aclose()
        return await wait_all_free(engine)

    run(loop, scenario())


def test_abort_ends_the_stream(engine, loop):
    async def scenario():
        gen = engine.generate("stop-me", [5, 6, 7], greedy(900))
        await gen.__anext__()
        await engine.abort("stop-me")
        with pytest.raises(EngineError, match="aborted"):
            async for _ in gen:
                pass
        return await wait_all_free(engine)

    run(loop, scenario())


def test_waiting_bound(engine, loop):
    async def scenario():
        running = engine.generate("running", [5, 6], greedy(900))
        await running.__anext__()                 # holds the only sequence
        queued = [engine.generate(f"queued{i}", [5, 6], greedy(1)) for i in range(3)]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in queued]
        await asyncio.sleep(0)                    # let each submit itself
        assert engine.num_waiting == 3
        with pytest.raises(QueueFullError, match="limits: 3 sequences"):
            await collect(engine, "one-too-many", [5], greedy(1))
        await running.aclose()
        for f in firsts:
            assert len((await f).new_token_ids) == 1
        for g in queued:
            await g.aclose()
        return await wait_all_free(engine)

    run(loop, scenario())
    assert engine.num_waiting == 0


def test_startup_error_comes_from_the_child(tiny_model_dir, tmp_path, loop):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")   # no weights
    eng = AsyncEngine(config(tmp_path))
    with one_omp_thread(), pytest.raises(EngineStartupError, match="no safetensors weights in"):
        loop.run_until_complete(eng.start())
    assert not eng.is_alive
    with pytest.raises(EngineError):
        run(loop, eng.stats())
