"""pytest run again in a child process (another environment: a forced ISA, no compiled
kernels, Triton's interpreter), for the tests that need a process of their own.

The child loads no plugins from entry points: none of these tests use one, and importing
hypothesis, schemathesis, langsmith, anyio and pytest-benchmark for nothing costs ~5 s of CPU
in every child (docs/design.md, the suite's time)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(args: list[str], env: dict[str, str] | None = None,
               timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m pytest -q -p no:cacheprovider *args` from the repository root, output
    captured as text; `env`: the whole environment (default: this one)."""
    env = {**(os.environ if env is None else env), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


# The engine tests that must also pass on the torch forms CUDA runs, selected by file and -k
TORCH_FORMS = {"tests/engine/test_decode_graphs.py": "replays",
               "tests/engine/test_device_resident.py": "never_read_back"}


@functools.cache
def torch_forms_run() -> subprocess.CompletedProcess:
    """TORCH_FORMS run once, in one child process without the compiled CPU kernels
    (KDASERVE_CPU_KERNELS=0: the kernels' choice is made once per process), for each of the
    tests that ask (one process start and collection instead of one per file)."""
    env = {**os.environ, "KDASERVE_CPU_KERNELS": "0"}
    return run_pytest(["-rA", *TORCH_FORMS, "-k", " or ".join(TORCH_FORMS.values())], env,
                      timeout=900)


def torch_forms_outcome(path: str) -> tuple[int, str]:
    """How many of `path`'s selected tests passed in torch_forms_run, and what to show when
    not all did (its failures, errors and the run's tail)."""
    done = torch_forms_run()
    lines = done.stdout.splitlines()
    passed = sum(line.startswith(f"PASSED {path}::") for line in lines)
    bad = [line for line in lines if line.startswith((f"FAILED {path}", f"ERROR {path}"))]
    return passed, "\n".join(bad) + "\n" + done.stdout[-3000:] + done.stderr[-2000:]
