#!/bin/bash
# Issue 14, first slice, call A: weight refinement in the backend (device-side selection and
# column gather from mapped host memory, inside the step graph). Conformance of the new ops,
# per-kernel times of a refined step (graphs off), and tg128 of the Llama-3.1-8B shape (rtn2,
# qtip2 HYB) with synthetic refinement at k = 4, 8, 16, 32 beside the base, in one process each.
# Leaves the binaries and the first GGUF part in /tmp for call B.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/
B=/tmp/x/sfx
$B test-backend --device cuda --op select_channels --op add_selected_columns > $OUT/test_backend.md 2>&1
echo "conformance rc=$?"; grep -E "cases on|FAIL|fail" $OUT/test_backend.md | head
SFX_PROFILE_KERNELS=1 timeout 120 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn2 -p 0 -n 4 -r 1 \
  --fit --k 16 --graphs off > $OUT/profile.md 2> $OUT/profile.txt; echo "profile rc=$?"
grep -E "refine|matvec|norm|add|share" $OUT/profile.txt | sort -t'|' -k5 -nr | head -30
timeout 200 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn2 -p 0 -n 128 -r 3 \
  --fit --k 4,8,16,32 > $OUT/bench_rtn2.md 2> $OUT/bench_rtn2.err; echo "bench rtn2 rc=$?"
cat $OUT/bench_rtn2.md; grep refinement $OUT/bench_rtn2.err
timeout 200 $B bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 128 -r 3 \
  --fit --k 4,8,16,32 > $OUT/bench_qtip2.md 2> $OUT/bench_qtip2.err; echo "bench qtip2 rc=$?"
cat $OUT/bench_qtip2.md
