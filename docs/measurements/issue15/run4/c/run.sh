#!/bin/bash
# Issue 15, fourth slice, call C (build D = the landed code): the scoring blocks reduce the split
# statistics with every thread and batch their merge loads; the selection gathers the keys at
# or above its first digit's bin into shared memory (SFX_KV_SELECT_L2=1 keeps the L2 passes);
# the correction issues its unit reads and its first record reads before storing the units.
# Conformance (both selection paths), per-kernel times at 32K (graphs off), tg128 at 4K and
# 32K in one process. Also leaves the binaries and the first GGUF part in /tmp for call D.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/
B=/tmp/x/sfx
$B test-backend --device cuda --op kvarn > $OUT/test_backend.md 2>&1; echo "conformance rc=$?"
SFX_KV_SELECT_L2=1 $B test-backend --device cuda --op kvarn > $OUT/test_backend_select_l2.md 2>&1; echo "conformance (L2 selection) rc=$?"
grep "cases on" $OUT/test_backend.md $OUT/test_backend_select_l2.md
SFX_PROFILE_KERNELS=1 timeout 100 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
  -d 32768 --kv 2/2+4/4 --graphs off > /dev/null 2> $OUT/profile.txt; echo "profile rc=$?"
SFX_KV_SELECT_L2=1 SFX_PROFILE_KERNELS=1 timeout 100 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
  -d 32768 --kv 2/2+4/4 --graphs off > /dev/null 2>> $OUT/profile.txt; echo "profile (L2 selection) rc=$?"
grep -E "tg4|kvarn" $OUT/profile.txt
timeout 220 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 \
  -d 4096,32768 --kv f16,2/2,2/2+4/4,2/2+4/4@vram > $OUT/bench.md 2> $OUT/bench.err; echo "bench rc=$?"
cat $OUT/bench.md
