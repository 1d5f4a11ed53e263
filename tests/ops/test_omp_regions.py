"""The fused decode step opens no serial OpenMP region (csrc/threads.h): libgomp builds a team
and makes a futex call for every `parallel`, a one-thread one too (an `if` clause that fails, a
region nested in the MoE's expert loop), and the demo's one-row step once met 207 of them (of
260: ~0.65 us each, a fifth of the step). Counted by an LD_PRELOAD shim around GOMP_parallel
(omp_regions.c) in a process of its own, over the bundled demo's decode steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from compiled_kernels import needs_kernels

pytestmark = [needs_kernels,
              pytest.mark.skipif(sys.platform != "linux" or shutil.which("gcc") is None,
                                 reason="the shim needs gcc and glibc's LD_PRELOAD")]

SCRIPT = r"""
import ctypes, json, sys
import torch
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.llm import LLM
from kdaserve.request import SamplingParams
import kdaserve.model.fused_decode as fd

shim = ctypes.CDLL(sys.argv[1])
torch.set_num_threads(2)
llm = LLM(str(kimi_linear_demo_path()), max_model_len=512, max_num_seqs=4)
steps = [0]
plain = fd.FusedDecoder.__call__
def counted(self, *a, **k):
    shim.omp_regions_start(b"decode_cpu")
    try:
        return plain(self, *a, **k)
    finally:
        shim.omp_regions_stop()
        steps[0] += 1
        totals.append((shim.omp_regions_total(), shim.omp_regions_serial()))
totals = []
fd.FusedDecoder.__call__ = counted
sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
llm.generate([{"prompt_token_ids": list(range(10, 40))}], sp, use_tqdm=False)
llm.generate([{"prompt_token_ids": list(range(50, 60 + 7 * b))} for b in range(3)], sp,
             use_tqdm=False)
print(json.dumps({"steps": steps[0], "regions": [t for t, _ in totals],
                  "serial": [s for _, s in totals]}))
"""


def test_fused_decode_opens_no_serial_region(tmp_path):
    from kdaserve.ops.cpu_kernels import decode_block_kernels

    if not decode_block_kernels().parallel:
        pytest.skip("the kernels were built without OpenMP")
    shim = tmp_path / "omp_regions.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-fopenmp",
                    str(Path(__file__).with_name("omp_regions.c")), "-o", str(shim), "-ldl"],
                   check=True, timeout=120)
    env = {**os.environ, "LD_PRELOAD": str(shim), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(shim)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["steps"] >= 10                      # one row, then three
    assert min(got["regions"]) > 0                 # the split products: the shim counts
    assert got["serial"] == [0] * got["steps"], got
