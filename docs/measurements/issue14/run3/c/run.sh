#!/bin/bash
# Issue 14, third slice, call C (after call B): the build with `_rf` kernel entries (the
# refinement's code only in launches that refine, so unrefined launches get the unrefined
# kernels' registers back), fused launches only for sets fetch lead staged, and the coded
# refined decode cases' bound set by the coded prefill (with an unrefined group-coded control).
# Binaries (carry [".gpu"]): .gpu/main.xz = cad5c6a (before the slice), .gpu/fused.xz = 109d8dd
# (call B's), .gpu/rf.xz = this build; each `make build-gpu`, stripped, xz-compressed.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt $1 ]; }
mkdir -p /tmp/c; for n in main fused rf; do xz -dc .gpu/$n.xz > /tmp/c/$n; chmod +x /tmp/c/$n; done
timeout 200 /tmp/c/rf test-backend --device cuda --op model_decode --op refined --op group --op trellis \
  > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | cut -c1-150 | head -8
grep -E "q2g32|q4g32" $O/test_backend.md | cut -c1-150
SFX_FUSED_REFINE=1 timeout 90 /tmp/c/rf test-backend --device cuda --op model_decode > $O/test_backend_fused.md 2>&1
echo "fused engine rc=$?: $(grep 'cases on cuda' $O/test_backend_fused.md)"; grep -E "FAIL" $O/test_backend_fused.md | head -4
echo "t=$(( $(date +%s) - t0 ))"
# Unrefined base, three builds, two alternating rounds.
for round in 1 2; do for q in rtn2 qtip2; do for n in main fused rf; do
  left 330 || break 3
  timeout 40 /tmp/c/$n bench $M --quant $q -p 0 -n 128 -r 3 2>/dev/null | grep -E "tg128" | awk -F'|' -v n=$n -v q=$q -v r=$round '{print "round", r, n, q, "base", $10}'
done; done; done
echo "t=$(( $(date +%s) - t0 ))"
# Where the base's time goes, per kernel (graphs off), before the slice and now.
for q in rtn2 qtip2; do for n in main rf; do
  left 380 || break 2
  SFX_PROFILE_KERNELS=1 timeout 40 /tmp/c/$n bench $M --quant $q -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_${q}_$n.txt
done; done
echo "t=$(( $(date +%s) - t0 ))"
# Refined, lead/lag (q/k/v and gate/up fused when SFX_FUSED_REFINE=1) and s = 0 (never fused now).
for q in rtn2 qtip2; do for v in 0 1; do
  left 520 || break 2
  SFX_FUSED_REFINE=$v timeout 60 /tmp/c/rf bench $M --quant $q --fit --k 4,16,32 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > $O/bench_${q}_lead_f$v.md 2>&1
  echo "$q lead fused=$v t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_lead_f$v.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_lead_f$v.md
done; done
for q in rtn2 qtip2; do
  left 560 || break
  timeout 40 /tmp/c/rf bench $M --quant $q --fit --k 4,16 -p 0 -n 128 -r 2 > $O/bench_${q}_s0.md 2>&1
  echo "$q s=0 t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_s0.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_s0.md
done
echo "total $(( $(date +%s) - t0 )) s"
