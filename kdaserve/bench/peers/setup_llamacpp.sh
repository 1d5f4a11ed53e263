#!/usr/bin/env bash
# The llama.cpp peer of `kdaserve bench compare` (not part of CI; docs/benchmarks.md):
#   setup_llamacpp.sh PEERS_DIR MODEL_DIR [GGUF_TYPE=f32] [PYTHON=python3]
# 1. PEERS_DIR/llamacpp-venv: llama-cpp-python 0.3.36 built from source for this CPU
#    (~7 min on 2 free cores; much longer on a loaded machine);
# 2. PEERS_DIR/sdist: the same release's source, for llama.cpp's converter;
# 3. PEERS_DIR/models/<model>-<type>.gguf: the checkpoint converted by convert_hf_to_gguf.py,
#    run by PYTHON (it needs torch, transformers, safetensors) through convert_gguf.py, which
#    maps a ByteLevel BPE tokenizer the converter does not know to llama.cpp's "gpt-2"
#    pre-tokenizer.
set -euo pipefail
PEERS=${1:?peers dir}
MODEL=${2:?model dir}
TYPE=${3:-f32}
PY=${4:-python3}
VERSION=0.3.36
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$PEERS/models" "$PEERS/sdist"
if [ ! -x "$PEERS/llamacpp-venv/bin/python" ] || \
   ! "$PEERS/llamacpp-venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  "$PY" -m venv "$PEERS/llamacpp-venv"
  # LLAVA_BUILD=OFF: the multimodal tools are not needed (and clash with LLAMA_BUILD_TOOLS)
  ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
  if grep -q -w amx_int8 /proc/cpuinfo; then
    # On AMX CPUs a native build puts Q8_0/Q4_0 weights in the AMX buffer type, whose graphs
    # this model's fail to schedule (ggml-backend.cpp: GGML_ASSERT(*cur_backend_id != -1), as
    # in llama.cpp issues 18099 and 19184). Without AMX the CPU_REPACK layouts stay on.
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    ARGS="$ARGS -DCMAKE_C_FLAGS='$NOAMX' -DCMAKE_CXX_FLAGS='$NOAMX'"
  fi
  CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    nice -n 19 "$PEERS/llamacpp-venv/bin/pip" install --no-cache-dir "llama-cpp-python==$VERSION"
fi
SRC="$PEERS/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS/sdist"
  tar xzf "$PEERS/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS/sdist"
fi
OUT="$PEERS/models/$(basename "$MODEL")-$TYPE.gguf"
"$PY" "$HERE/convert_gguf.py" "$SRC" "$MODEL" --outtype "$TYPE" --outfile "$OUT"
echo "peer ready: $PEERS/llamacpp-venv, $OUT"
