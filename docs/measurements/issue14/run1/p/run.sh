#!/bin/bash
# Issue 14, first slice, call P: the review build (one RamStore range helper, one construction
# path in open_refinement, the device's branch events destroyed with it, one grid-extent
# constant). Conformance of the refinement and KVarN ops, and tg128 of the Llama-3.1-8B shape
# (rtn2, qtip2 HYB) at k = 4, 16 beside the base; leaves the binaries and the first GGUF part
# in /tmp for call Q.
set -u
mkdir -p /tmp/x /tmp/s && tar -xJf .gpu/bin.tar.xz -C /tmp/x && cp .gpuA/gguf.part.aa /tmp/s/
B=/tmp/x/sfx
$B test-backend --device cuda --op select_channels --op add_selected_columns --op kvarn > $OUT/test_backend.md 2>&1
echo "conformance rc=$?"; grep -E "cases on" $OUT/test_backend.md
for q in rtn2 qtip2; do
  timeout 150 $B bench --synthetic llama-3.1-8b --device cuda --quant $q -p 0 -n 128 -r 3 --fit --k 4,16 \
    > $OUT/bench_$q.md 2> $OUT/bench_$q.err; echo "bench $q rc=$?"
  sed -n '/× base/,$p' $OUT/bench_$q.md; grep "| - |" $OUT/bench_$q.md | cut -d'|' -f10
done
