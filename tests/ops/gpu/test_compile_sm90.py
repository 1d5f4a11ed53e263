"""The kernels compile for an H200 (sm_90) at the model's shapes, on any machine: the
interpreter runs what the kernels compute but not Triton's GPU lowering (tl.dot's shape and
type rules, layouts, shared memory), so that is checked here, and that no variant spills
registers to local memory. Needs triton's NVIDIA backend, not a GPU (compile_sm90.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[3]


def test_kernels_compile_for_sm90_without_spills():
    if torch.cuda.is_available():   # the other tests run the kernels; triton's AOT API varies
        pytest.skip("on a GPU the kernels themselves run")
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_sm90.py"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    usage = json.loads(proc.stdout)
    assert {"kda_decode_bf16_keep1", "mla_split_bf16", "mla_split_fp32", "mla_merge"} <= set(usage)
    for name, u in usage.items():
        assert u["STACK"] == 0 and u["LOCAL"] == 0, (name, u)
        assert u["REG"] <= 255, (name, u)
