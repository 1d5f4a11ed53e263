#!/usr/bin/env bash
# A GPU session's checks for issue 30, in one run of the `device` tool (15 minutes of device
# time a session, machine start included: this takes about 8).
#   prepare here:  bash .device/prepare.sh          (wheels the device lacks, into .device/wheels)
#   run there:     run(command="bash .device/cuda_check.sh 420", carry=[".device/wheels"],
#                      timeout_s=590)
# Results land in $OUT: gpu.txt, env.txt, kernels.txt (tests/ops/gpu on CUDA), cuda-h200.json
# (`kdaserve bench cuda`; docs/cuda-h200.json is this file), bench.log.
set -uo pipefail
OUT=${OUT:-/tmp/kdaserve-device}
mkdir -p "$OUT"
BUDGET=${1:-420}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if compgen -G ".device/wheels/*.whl" > /dev/null; then
  python3 -m pip install --no-deps --no-index --quiet .device/wheels/*.whl 2>&1 | tail -3
fi
export PYTHONPATH=$PWD
python3 - <<'PY' | tee "$OUT/env.txt"
import importlib
for m in ("torch", "triton", "fla", "einops", "pytest", "msgspec", "safetensors", "tokenizers",
          "llguidance", "tqdm"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING", type(e).__name__, e)
PY
# 1. the Triton kernels against their torch references on the GPU (first use compiles them)
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/ops/gpu > "$OUT/kernels.txt" 2>&1
echo "kernels rc=$?" >> "$OUT/kernels.txt"
tail -15 "$OUT/kernels.txt"
# 2. the bench (its CLI parser imports the server, which this machine lacks: call run())
timeout $((BUDGET + 90)) python3 - "$OUT" "$BUDGET" <<'PY' > "$OUT/bench.log" 2>&1
import argparse, sys
from kdaserve.bench.cuda import cli
out, budget = sys.argv[1], sys.argv[2]
p = argparse.ArgumentParser()
cli.add_arguments(p)
args = p.parse_args(["--json", "--out", f"{out}/cuda-h200.json", "--budget-s", budget,
                     "--sections", "correctness", "graphs", "throughput", "shapes48b", "spec"])
cli.run(args)
PY
echo "bench rc=$?" >> "$OUT/bench.log"
tail -c 4000 "$OUT/bench.log"
