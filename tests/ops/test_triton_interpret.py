"""Runs tests/ops/gpu (the Triton kernels against their torch references) under Triton's
interpreter on CPU, in a subprocess whose path holds a side install of triton.

.ci/run installs triton there (KDASERVE_TRITON_SITE, default ~/.cache/kdaserve/triton-site);
it is kept out of the main environment because transformers' kimi_linear switches to fla's
Triton kernels whenever triton imports, and those fail on CPU.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from sub_pytest import run_pytest

ROOT = Path(__file__).resolve().parents[2]


def triton_site() -> Path | None:
    site = Path(os.environ.get("KDASERVE_TRITON_SITE",
                               Path.home() / ".cache" / "kdaserve" / "triton-site"))
    return site if (site / "triton" / "__init__.py").exists() else None


def test_triton_kernels_under_interpreter():
    site = triton_site()
    if site is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI: .ci/run should have installed triton into KDASERVE_TRITON_SITE")
        pytest.skip("no side install of triton (run .ci/run, or pip install --target)")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    proc = run_pytest(["tests/ops/gpu"], env)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, tail
    assert " skipped" not in proc.stdout.splitlines()[-1], tail
