#!/usr/bin/env bash
# Installs the pinned CUDA compiler from PyPI into a git-ignored cache (default ./.cache/cuda-tools)
# so `cargo build` compiles the CUDA kernels on a machine without a GPU or a CUDA toolkit. The
# five packages are pinned together: the 13.0 line matches the CUDA 13.0 drivers the kernels
# are tested on (a newer nvvm/crt emits PTX an older driver may refuse). Idempotent.
# Prints the nvcc path on stdout.
set -euo pipefail
DEST="${SFX_CUDA_TOOLS:-$(cd "$(dirname "$0")/.." && pwd)/.cache/cuda-tools}"
NVCC="$DEST/nvidia/cu13/bin/nvcc"
if [[ -x "$NVCC" ]] && "$NVCC" --version 2>/dev/null | grep -q "release 13.0"; then
  echo "$NVCC"
  exit 0
fi
echo "sfx-cuda-tools: installing nvcc 13.0.88 (PyPI) into $DEST" >&2
mkdir -p "$DEST"
python3 -m pip install -q --no-cache-dir --target "$DEST.part" \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
rm -rf "$DEST"
mv "$DEST.part" "$DEST"
"$NVCC" --version >&2
echo "$NVCC"
