#!/bin/bash
# Diagnostics on the landed build: (1) what bounds the rtn4 tile matvecs (ncu --set full of one
# gate/up and one down launch); (2) where the qtip2 transform launches spend their time (ncu
# warp-state sampling per SASS line of tr_finish, tr_finish_swiglu, tr_prepare_rm).
mkdir -p /tmp/final; xz -dc .gpu/xz/final.xz > /tmp/final/sfx; chmod +x /tmp/final/sfx; S=/tmp/final/sfx
M="--synthetic llama-3.1-8b --device cuda"; O=$OUT; t0=$(date +%s)
timeout 60 ncu --clock-control none --cache-control none --set full --kernel-name regex:gt_swiglu_norm --launch-skip 20 --launch-count 1 \
  $S bench $M --quant rtn4 -p 0 -n 2 -r 1 --graphs off > $O/ncu_swiglu_full.txt 2>&1
timeout 60 ncu --clock-control none --cache-control none --set full --kernel-name regex:'gt_matvec_b4' --launch-skip 21 --launch-count 1 \
  $S bench $M --quant rtn4 -p 0 -n 2 -r 1 --graphs off > $O/ncu_down_full.txt 2>&1
grep -E "gt_|Duration|Memory Throughput|DRAM Throughput|Issued Warp|Eligible|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit" $O/ncu_*_full.txt
echo "rtn4 $(( $(date +%s) - t0 )) s"
timeout 200 ncu --clock-control none --cache-control none --kernel-name regex:'tr_finish|tr_prepare' --launch-skip 50 --launch-count 5 \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight --import-source no \
  -o /tmp/rep $S bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off > $O/ncu_tr_run.txt 2>&1
ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2> $O/src_err.txt
gzip -c /tmp/src.csv > $O/tr_src.csv.gz
ncu -i /tmp/rep.ncu-rep --page details > $O/tr_details.txt 2>&1
grep -E "tr_|Duration|Issued Warp|Warp Cycles Per Issued|Registers Per" $O/tr_details.txt
echo "total $(( $(date +%s) - t0 )) s"
