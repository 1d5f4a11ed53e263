"""A script that creates LLM(tensor_parallel_size=2) without `if __name__ == "__main__":`:
its spawned workers re-import it and try to start workers of their own. The engine's error
names that cause (the worker's own error) and the fix, instead of only "rank 0 exited with
code 1"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.llm import LLM

llm = LLM(str(kimi_linear_demo_path()), tensor_parallel_size=2, num_threads=1)
print("started", flush=True)
"""


def test_unguarded_script_names_the_cause_and_the_fix(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "started" not in proc.stdout
    last = proc.stderr.strip().splitlines()
    error = "\n".join(last[last.index(next(x for x in last if "ExecutorError" in x)):])
    assert "a worker process died while starting" in error, proc.stderr[-3000:]
    assert "finished its bootstrapping phase" in error, proc.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in error and "re-import the main script" in error
    assert not list(tmp_path.glob("kdaserve-worker-*.err"))
