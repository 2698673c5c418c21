#!/bin/bash
# Issue 14, fourth slice, call B: is a refined token's extra time fixed (launches, joins) or per
# byte (transfers)? rtn2 and qtip2 at k = 1, 4, 16 with lead/lag (fused default and branches)
# and at s = 0, step graphs on. Binary: .gpu/final.xz (d6c91ee).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/f; xz -dc .gpu/final.xz > /tmp/f/sfx; chmod +x /tmp/f/sfx; B=/tmp/f/sfx
for q in rtn2 qtip2; do
  for v in lead branches s0; do
    case $v in lead) S="--s 1,0.5,1,0.5"; E=1;; branches) S="--s 1,0.5,1,0.5"; E=0;; s0) S="--s 0"; E=1;; esac
    SFX_FUSED_REFINE=$E timeout 60 $B bench $M --quant $q --fit --k 1,4,16 $S -p 0 -n 128 -r 2 > $O/bench_${q}_$v.md 2>&1
    echo "$q $v t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_$v.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_$v.md
  done
done
echo "total $(( $(date +%s) - t0 )) s"
