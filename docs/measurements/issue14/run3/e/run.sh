#!/bin/bash
# Issue 14, third slice, call E (warm, right after call D): fused launches against the branch
# path on call C's build, fetch lead/lag s = 1,0.5,1,0.5, k = 4, 8, 16, 24, twice each,
# alternating, to place the k above which the fused launches lose.
M="--synthetic llama-3.1-8b --device cuda"; mkdir -p /tmp/e; xz -dc .gpu/rf.xz > /tmp/e/rf; chmod +x /tmp/e/rf
for q in rtn2 qtip2; do for v in 0 1 0 1; do
  SFX_FUSED_REFINE=$v timeout 60 /tmp/e/rf bench $M --quant $q --fit --k 4,8,16,24 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 2>/dev/null > /tmp/e/b.md
  echo "$q fused=$v $(grep -E '\| - \| tg128' /tmp/e/b.md | awk -F'|' '{print "base", $10}')"; grep -E "^\| f16 \| tg128" /tmp/e/b.md
done; done
