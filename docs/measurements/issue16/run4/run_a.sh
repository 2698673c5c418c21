#!/usr/bin/env bash
# Call A: unpack the binaries (sfx, sfx-convert, sfx-run; stripped, xz -9e) and the texts into
# /tmp/w (kept while the machine stays warm).
set -euo pipefail
mkdir -p /tmp/w/assets
xz -dc .gpu/bins.tar.xz | tar xf - -C /tmp/w
cp -r assets/brown assets/austen assets/wiki /tmp/w/assets/
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
nproc | tee -a $OUT/gpu.txt
lscpu | grep "Model name" | tee -a $OUT/gpu.txt
/tmp/w/sfx --version | tee -a $OUT/gpu.txt
which python3 jq | tee -a $OUT/gpu.txt || true
