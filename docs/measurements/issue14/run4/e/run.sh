#!/bin/bash
# Issue 14, fourth slice, call E: call D's build plus fetch lead's staged operand read ahead in
# the group tile kernels (cp.async of the block's column bytes, the selection and the scales
# before the weights' loads; x̂ from the staged x planes), against d6c91ee. Conformance of the
# new build, two alternating rounds (rtn2, qtip2; k = 1, 4, 16 under lead/lag), then
# per-kernel times of rtn2 k = 1 (graphs off).
# Binaries: .gpu/final.xz (d6c91ee), .gpu/ahead.xz (this build).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/e; for n in final ahead; do xz -dc .gpu/$n.xz > /tmp/e/$n; chmod +x /tmp/e/$n; done
timeout 100 /tmp/e/ahead test-backend --device cuda --op model_decode --op refined --op lead_columns > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | cut -c1-150 | head -8
grep -E "staged" $O/test_backend.md | grep -E "q2g128" | cut -c1-150
echo "t=$(( $(date +%s) - t0 ))"
for round in 1 2; do for q in rtn2 qtip2; do for n in final ahead; do
  timeout 60 /tmp/e/$n bench $M --quant $q --fit --k 1,4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > /tmp/e/b.md 2>&1
  echo "round $round $q $n t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" /tmp/e/b.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" /tmp/e/b.md
done; done; done
SFX_PROFILE_KERNELS=1 timeout 60 /tmp/e/ahead bench $M --quant rtn2 --fit --k 1 --s 1,0.5,1,0.5 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_rtn2_k1_lead.txt
echo "total $(( $(date +%s) - t0 )) s"
