#!/bin/bash
# Issue 14, fourth slice, call D: fetch lead stages a set's projections in one launch (q/k/v:
# one instead of three; gate/up: one instead of two) and fetch lag's gathers get a lane of
# their own, against d6c91ee, where every far-lane launch (5 stagings and 2 lag gathers a
# layer) queued on one stream. Conformance of the new build first; then two alternating
# rounds, rtn2 and qtip2, k = 1, 4, 16 under lead/lag; then per-kernel times (graphs off).
# Binaries: .gpu/final.xz (d6c91ee), .gpu/lanes.xz (this build).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/d; for n in final lanes; do xz -dc .gpu/$n.xz > /tmp/d/$n; chmod +x /tmp/d/$n; done
timeout 90 /tmp/d/lanes test-backend --device cuda --op model_decode --op refined --op lead_columns > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | cut -c1-150 | head -8
echo "t=$(( $(date +%s) - t0 ))"
for round in 1 2; do for q in rtn2 qtip2; do for n in final lanes; do
  timeout 60 /tmp/d/$n bench $M --quant $q --fit --k 1,4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > /tmp/d/b.md 2>&1
  echo "round $round $q $n t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" /tmp/d/b.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" /tmp/d/b.md
done; done; done
SFX_PROFILE_KERNELS=1 timeout 60 /tmp/d/lanes bench $M --quant rtn2 --fit --k 1 --s 1,0.5,1,0.5 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_rtn2_k1_lead.txt
echo "total $(( $(date +%s) - t0 )) s"
