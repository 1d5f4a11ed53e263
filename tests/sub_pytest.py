"""pytest run again in a child process (another environment: a forced ISA, no compiled
kernels, Triton's interpreter), for the tests that need a process of their own.

The child loads no plugins from entry points: none of these tests use one, and importing
hypothesis, schemathesis, langsmith, anyio and pytest-benchmark for nothing costs ~5 s of CPU
in every child (docs/design.md, the suite's time)."""

from __future__ import annotations

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
