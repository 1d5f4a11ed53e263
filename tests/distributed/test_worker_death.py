"""A worker that dies mid-run ends the engine with a clear error in bounded time (no hang),
and no worker outlives its engine. The engine runs in a child interpreter so the test can
watch its exit code and its workers' pids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdaserve.model.loader import save_model

from tiny_models import random_model, tiny_config

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, signal, sys
from kdaserve.engine.executor import ExecutorError
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_threads=1, cache_memory=8 << 20,
              max_model_len=512)
    eng = llm.engine
    print(json.dumps(eng.executor.worker_pids), flush=True)
    eng.add_request("a", [3, 4, 5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(3):
        eng.step()
    if sys.argv[2] == "kill-worker":
        os.kill(eng.executor.worker_pids[1], signal.SIGKILL)
    else:                       # wait to be killed
        sys.stdin.read()
    try:
        while eng.has_unfinished():
            eng.step()
    except ExecutorError as exc:
        print("ENGINE ERROR:", exc, flush=True)
        sys.exit(3)
    sys.exit(0)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kl")
    save_model(random_model(tiny_config(num_attention_heads=2)), out)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:      # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _start(model_dir, mode: str) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(model_dir), mode], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the engine did not start"
    return proc, json.loads(line)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a worker outlived its engine"


def test_killed_worker_ends_engine_with_error(model_dir):
    proc, pids = _start(model_dir, "kill-worker")
    out, _ = proc.communicate(timeout=120)      # bounded: a hang fails the test here
    assert proc.returncode == 3, out
    assert "ENGINE ERROR: a worker process died" in out
    assert "rank 1 exited with code -9" in out
    _wait_gone(pids, 10)


def test_workers_die_with_killed_engine(model_dir):
    proc, pids = _start(model_dir, "wait")
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _wait_gone(pids, 15)


def test_idle_longer_than_worker_timeout(model_dir):
    """The other ranks wait for the next step without the worker timeout (which bounds the
    model's collectives): an engine idle for longer than it still runs the next request."""
    from kdaserve.config import EngineConfig, ParallelConfig
    from kdaserve.engine.core import EngineCore
    from kdaserve.request import SamplingParams

    config = EngineConfig(model=str(model_dir), num_threads=1,
                          parallel=ParallelConfig(tensor_parallel_size=2, worker_timeout_s=2.0))
    eng = EngineCore(config)
    try:
        for name in ("before", "after"):
            eng.add_request(name, [3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
            while eng.has_unfinished():
                eng.step()
            if name == "before":
                time.sleep(4.0)          # twice the worker timeout with no step
    finally:
        eng.shutdown()
