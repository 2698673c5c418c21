#!/bin/bash
# Issue 14, third slice, call F: the landed build (fused launches the default for staged sets
# at k <= 16, `_rf` kernel entries), trimmed to the device time left: the model_decode and
# refined conformance with the default engine and model_decode with the branches, then the default refined decode of
# rtn2 and qtip2 HYB at s = 1,0.5,1,0.5 (s = 0 never fuses: call C's rows are this path).
# Binary (carry [".gpu"]): .gpu/final.xz = `make build-gpu` of this commit, stripped, xz.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/f; xz -dc .gpu/final.xz > /tmp/f/sfx; chmod +x /tmp/f/sfx; B=/tmp/f/sfx
timeout 45 $B test-backend --device cuda --op model_decode --op refined > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | cut -c1-150 | head -8
grep -E "refined k16" $O/test_backend.md | cut -c1-150
SFX_FUSED_REFINE=0 timeout 30 $B test-backend --device cuda --op model_decode > $O/test_backend_branches.md 2>&1
echo "branches rc=$?: $(grep 'cases on cuda' $O/test_backend_branches.md)"; grep -E "FAIL" $O/test_backend_branches.md | cut -c1-150 | head -4
echo "t=$(( $(date +%s) - t0 ))"
for q in rtn2 qtip2; do
  timeout 25 $B bench $M --quant $q --fit --k 4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > $O/bench_${q}_lead.md 2>&1
  echo "$q lead t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_lead.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_lead.md
done
echo "total $(( $(date +%s) - t0 )) s"
