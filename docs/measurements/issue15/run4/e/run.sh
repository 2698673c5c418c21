#!/bin/bash
# Issue 15, fourth slice, call E: the landed build (call C's kernels plus centred codes in the
# attention's hoisted sums). Conformance with both selection paths and per-kernel times at
# 32K (graphs off); leaves the binaries and the first GGUF part in /tmp for calls F and G.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/
B=/tmp/x/sfx
$B test-backend --device cuda --op kvarn > $OUT/test_backend.md 2>&1; echo "conformance rc=$?"
SFX_KV_SELECT_L2=1 $B test-backend --device cuda --op kvarn > $OUT/test_backend_select_l2.md 2>&1; echo "conformance (L2 selection) rc=$?"
grep "cases on" $OUT/test_backend.md $OUT/test_backend_select_l2.md
grep -E "\| (2/2|3/2) 32/8×128 sinks 128 tiles 40 tail 77" $OUT/test_backend.md
SFX_PROFILE_KERNELS=1 timeout 100 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
  -d 32768 --kv 2/2,2/2+4/4 --graphs off > /dev/null 2> $OUT/profile.txt; echo "profile rc=$?"
grep -E "tg4|kvarn" $OUT/profile.txt
