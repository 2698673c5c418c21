#!/bin/bash
# Issue 13, twelfth slice, call B: what bounds each of a layer's four qtip2 HYB decode matvecs
# (ncu --set full of q/k/v, o, gate/up, down of one layer, graphs off), and programmatic
# dependent launch on the group codes and with the trellis transforms left out (diagnostic
# build, as call A).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/d; xz -dc .gpu/diag.xz > /tmp/d/sfx; chmod +x /tmp/d/sfx; S=/tmp/d/sfx
timeout 150 ncu --clock-control none --cache-control none --set full --kernel-name regex:tr_matvec --launch-skip 40 --launch-count 4 \
  $S bench $M --quant qtip2 -p 0 -n 2 -r 1 --graphs off > $O/ncu_matvec_full.txt 2>&1
grep -E "tr_matvec|Duration|Elapsed Cycles|SM Active Cycles|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Executed Ipc Active|Achieved Occupancy|Memory Throughput|DRAM Throughput" $O/ncu_matvec_full.txt
echo "ncu $(( $(date +%s) - t0 )) s"
tg() { timeout 60 env $1 $S bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}'; }
for round in 1 2; do
  for q in rtn2 rtn4 qtip2; do echo "$q r$round pdl0 $(tg X=1 $q) pdl1 $(tg SFX_PDL=1 $q)"; done
  echo "qtip2 r$round pdl1 skip=finish+swiglu+prepare $(tg "SFX_PDL=1 SFX_DIAG_TR_SKIP=finish+swiglu+prepare" qtip2)"
done | tee $O/pdl.md
echo "total $(( $(date +%s) - t0 )) s"
