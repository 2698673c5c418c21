#!/bin/bash
B=$PWD/.gpu/bin; O=$OUT
cp $B/sfx /tmp/sfx; S=/tmp/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
SEC="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters"
for k in tr_finish_swiglu tr_prepare_rm 'tr_finish$'; do
  timeout 150 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 20 --launch-count 2 $SEC \
    $S bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off > $O/ncu_$(echo $k | tr -d '$').txt 2>&1
  echo "$k $(( $(date +%s) - t0 )) s"
done
timeout 200 ncu --clock-control none --kernel-name regex:tr_matvec --launch-skip 40 --launch-count 4 $SEC \
    $S bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off > $O/ncu_tr_matvec.txt 2>&1
echo "matvec $(( $(date +%s) - t0 )) s"
for f in $O/ncu_*.txt; do echo "== $f"; grep -E '^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|Issued Warp|Eligible Warps|Registers Per|Executed Instructions  |Block Limit Shared|Dynamic Shared' $f | head -40; done
