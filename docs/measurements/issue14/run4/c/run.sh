#!/bin/bash
# Issue 14, fourth slice, call C: branch launches at the context's greatest scheduling
# priority (SFX_BRANCH_PRIORITY, default on) against equal priority (=0), same binary, two
# alternating rounds; the base of d6c91ee beside it. rtn2 and qtip2, k = 1, 4, 16, lead/lag
# (fused default) and s = 0. Binaries: .gpu/final.xz (d6c91ee), .gpu/prio.xz (this build).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/c; for n in final prio; do xz -dc .gpu/$n.xz > /tmp/c/$n; chmod +x /tmp/c/$n; done
for round in 1 2; do
for q in rtn2 qtip2; do
  timeout 30 /tmp/c/final bench $M --quant $q -p 0 -n 128 -r 2 2>/dev/null | grep tg128 | awk -F'|' -v q=$q '{print "d6c91ee", q, "base", $10}'
  for p in 1 0; do for v in lead s0; do
    case $v in lead) S="--s 1,0.5,1,0.5";; s0) S="--s 0";; esac
    SFX_BRANCH_PRIORITY=$p timeout 60 /tmp/c/prio bench $M --quant $q --fit --k 1,4,16 $S -p 0 -n 128 -r 2 > $O/bench_${q}_${v}_p${p}_r$round.md 2>&1
    echo "round $round $q $v priority=$p t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_${v}_p${p}_r$round.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_${v}_p${p}_r$round.md
  done; done
done; done
echo "total $(( $(date +%s) - t0 )) s"
