#!/usr/bin/env bash
# Builds llama.cpp's CPU llama-bench and llama-quantize from the source that the
# llama-cpp-python sdist vendors (PyPI is reachable where GitHub is not), and writes the
# SmolLM2 GGUFs the CPU side-by-side compares against (scripts/cpu_side_by_side.py).
#
#   bash scripts/llamacpp_cpu.sh [DEST]      (default .peers/llamacpp-cpu; ~8 min on 2 cores)
#
# AVX-512 (VNNI, VBMI, BF16) is enabled explicitly rather than with -march=native: some VMs
# list AMX among the CPU's flags but fault on its instructions, and a native build uses them.
set -euo pipefail
DEST="${1:-.peers/llamacpp-cpu}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # vendors ggml-org/llama.cpp@0c1e57098
ASSETS="${SFX_ASSETS:-$PWD/assets}"
SOURCE_GGUF="$ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
if [ ! -d "$DEST/llama.cpp" ]; then
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==$VERSION"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST/llama.cpp"
fi
command -v cmake >/dev/null && command -v ninja >/dev/null || python3 -m pip install -q cmake ninja
cd "$DEST/llama.cpp"
avx512=OFF
grep -q avx512_vnni /proc/cpuinfo && grep -q avx512vbmi /proc/cpuinfo && avx512=ON
cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=$avx512 -DGGML_AVX512_VBMI=$avx512 -DGGML_AVX512_VNNI=$avx512 \
  -DGGML_AVX512_BF16=$avx512 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TOOLS=ON >/dev/null
cmake --build build -j"$(nproc)" --target llama-bench llama-quantize >/dev/null
mkdir -p "$DEST/models"
for q in Q4_0 Q4_K_M Q3_K_M Q2_K BF16; do
  out="$DEST/models/smol-$q.gguf"
  [ -s "$out" ] || ./build/bin/llama-quantize --allow-requantize "$SOURCE_GGUF" "$out" "$q" >/dev/null 2>&1
done
echo "llama-bench: $DEST/llama.cpp/build/bin/llama-bench; GGUFs: $DEST/models"
