#!/bin/bash
# Issue 14, second slice, call A: fetch lead and lag on the device. Conformance of the lead
# path's ops and the decode graphs, then tg128 of the Llama-3.1-8B shape with synthetic
# refinement at k = 4, 8, 16, 32 per 1024 (all sets), s = 0 / 0.5 / 1, rtn2 and qtip2 HYB.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/b; xz -dc .gpu/lead.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
timeout 120 $B test-backend --device cuda --op lead_columns --op select_channels --op add_selected_columns --op model_decode > $O/test_backend_refine.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_refine.md)"; grep -E "FAIL|fail" $O/test_backend_refine.md | head -5
for q in rtn2 qtip2; do
  for s in 0 0.5 1; do
    timeout 150 $B bench $M --quant $q --fit --k 4,8,16,32 --s $s -p 0 -n 128 -r 3 > $O/bench_${q}_s$s.md 2> $O/bench_${q}_s$s.err
    echo "== $q s=$s"; grep -A7 "× base" $O/bench_${q}_s$s.md | tail -5; grep -iE "error|panic" $O/bench_${q}_s$s.err | head -3
  done
done
echo "total $(( $(date +%s) - t0 )) s"
