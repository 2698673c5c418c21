#!/bin/bash
# Issue 14, fourth slice, call F: call E's build checked. (1) Is the coded k128 case that failed
# once in call E (tiny-qwen3 q4g32 refined k128 s[1,0,0.5,0], a path neither change of this
# slice enters: k > 16 is never fused) run-to-run variation? model_decode three times on this
# build and twice on d6c91ee. (2) The group, refined and lead conformance in full on this build.
# (3) The unrefined base, three alternating rounds (the tile kernels' plain entries changed
# only in where the refinement's addresses are formed).
# Binaries: .gpu/final.xz (d6c91ee), .gpu/ahead.xz (this build).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/f; for n in final ahead; do xz -dc .gpu/$n.xz > /tmp/f/$n; chmod +x /tmp/f/$n; done
for n in ahead final ahead final ahead; do
  timeout 60 /tmp/f/$n test-backend --device cuda --op model_decode > /tmp/f/md.md 2>&1
  echo "$n model_decode rc=$?: $(grep 'cases on cuda' /tmp/f/md.md | sed 's/(.*)//') t=$(( $(date +%s) - t0 ))"
  grep -E "refined k128|FAIL" /tmp/f/md.md | awk -F'|' '{print $3, $5, $7}'
done
timeout 150 /tmp/f/ahead test-backend --device cuda --op group --op refined --op lead > $O/test_backend_group_refined.md 2>&1
echo "group/refined/lead rc=$?: $(grep 'cases on cuda' $O/test_backend_group_refined.md)"; grep FAIL $O/test_backend_group_refined.md | cut -c1-160 | head
echo "t=$(( $(date +%s) - t0 ))"
for round in 1 2 3; do for q in rtn2 qtip2; do for n in final ahead; do
  timeout 30 /tmp/f/$n bench $M --quant $q -p 0 -n 128 -r 3 2>/dev/null | grep tg128 | awk -F'|' -v n=$n -v q=$q -v r=$round '{print "round", r, n, q, "base", $10}'
done; done; done
echo "total $(( $(date +%s) - t0 )) s"
