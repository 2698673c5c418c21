#!/bin/bash
# Issue 14, first slice, call D. Build D = build B plus branches: in a decode step each set's
# selection and gather run on a second stream beside the set's resident projection (a parallel
# path of the step graph), into per-set deltas added after the join. Conformance of the new
# ops; tg128 of the Llama-3.1-8B shape (rtn2: branches on, then off with SFX_BRANCHES=0, in
# separate processes back to back; qtip2 HYB: on) with synthetic refinement at k = 4, 8, 16, 32
# beside the base. Leaves the binaries and the first GGUF part in /tmp for call E.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/
B=/tmp/x/sfx
$B test-backend --device cuda --op select_channels --op add_selected_columns > $OUT/test_backend.md 2>&1
echo "conformance rc=$?"; grep -E "cases on|FAIL|fail" $OUT/test_backend.md | head
for br in 1 0; do
  SFX_BRANCHES=$br timeout 200 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn2 -p 0 -n 128 -r 3 \
    --fit --k 4,8,16,32 > $OUT/bench_rtn2_branches$br.md 2> $OUT/bench_rtn2_branches$br.err; echo "bench rtn2 branches=$br rc=$?"
  sed -n '/× base/,$p' $OUT/bench_rtn2_branches$br.md; grep "| - |" $OUT/bench_rtn2_branches$br.md | cut -d'|' -f10
done
timeout 200 $B bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 128 -r 3 \
  --fit --k 4,8,16,32 > $OUT/bench_qtip2.md 2> $OUT/bench_qtip2.err; echo "bench qtip2 rc=$?"
sed -n '/× base/,$p' $OUT/bench_qtip2.md; grep "| - |" $OUT/bench_qtip2.md | cut -d'|' -f10
