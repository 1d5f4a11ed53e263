#!/usr/bin/env bash
# Wheels the device machine lacks (it reaches no package index): pure-Python ones only, since
# its Python version may differ from this machine's. Carried with `carry=[".device/wheels"]`.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf wheels && mkdir -p wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.10 \
  --implementation py -d wheels fla-core==0.6.0 einops pytest pluggy iniconfig packaging \
  pygments tqdm
ls -la wheels
