#!/bin/bash
# Issue 14, fourth slice, call A: the landed build d6c91ee (run3/f's plan: conformance with the
# fused default and with branches, the default refined decode under lead/lag), then where a
# refined token's time goes: per-kernel profiles (graphs off) of rtn2 refined at k = 4, s = 0
# and s = 1,0.5,1,0.5, and each refined row with step graphs on and off.
# Binary (carry [".gpu"]): .gpu/final.xz = `make build-gpu` of d6c91ee, stripped, xz.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/f; xz -dc .gpu/final.xz > /tmp/f/sfx; chmod +x /tmp/f/sfx; B=/tmp/f/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 60 $B test-backend --device cuda --op model_decode --op refined > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | cut -c1-150 | head -8
grep -E "refined k16" $O/test_backend.md | cut -c1-150
SFX_FUSED_REFINE=0 timeout 40 $B test-backend --device cuda --op model_decode > $O/test_backend_branches.md 2>&1
echo "branches rc=$?: $(grep 'cases on cuda' $O/test_backend_branches.md)"; grep -E "FAIL" $O/test_backend_branches.md | cut -c1-150 | head -4
echo "t=$(( $(date +%s) - t0 ))"
for q in rtn2 qtip2; do
  timeout 40 $B bench $M --quant $q --fit --k 4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > $O/bench_${q}_lead.md 2>&1
  echo "$q lead t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_lead.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_lead.md
done
for s in 0 1,0.5,1,0.5; do
  SFX_PROFILE_KERNELS=1 timeout 60 $B bench $M --quant rtn2 --fit --k 4 --s $s -p 0 -n 16 -r 1 --graphs off > $O/profile_rtn2_k4_s${s:0:1}.md 2> $O/profile_rtn2_k4_s${s:0:1}.txt
  echo "profile s=$s t=$(( $(date +%s) - t0 ))"
done
timeout 60 $B bench $M --quant rtn2 --fit --k 4 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 --graphs both > $O/bench_rtn2_graphs.md 2>&1
grep -E "tg128" $O/bench_rtn2_graphs.md | cut -c1-200
echo "total $(( $(date +%s) - t0 )) s"
