#!/bin/bash
# Call B1: the whole-model tile cases (model_decode, group 128 at 2/3/4 bits), per-kernel decode
# times of rtn3 beside rtn2/rtn4 (graphs off) and ncu sections of rtn3's tile matvecs. Carries
# the first part of SmolLM2 rtn3.sfx for call B3.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/b $O/b1
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; S=/tmp/b/sfx; cp .gpu/rtn3.p1 /tmp/b/
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 120 $S test-backend --device cuda --op model_decode --seed 1 > $O/b1/model_decode.md 2>&1
echo "[$(el)s] model_decode rc=$?: $(grep 'cases on cuda' $O/b1/model_decode.md)"; grep "g128" $O/b1/model_decode.md | cut -d'|' -f3,5,6,7
for q in rtn3 rtn2 rtn4; do
  SFX_PROFILE_KERNELS=1 timeout 60 $S bench --synthetic llama-3.1-8b --device cuda --quant $q -p 0 -n 32 -r 1 --graphs off > $O/b1/profile_$q.md 2>&1
  echo "[$(el)s] profile $q"; grep -E "gt_|gq_" $O/b1/profile_$q.md | head -12
done
for k in gt_swiglu_norm_b3 gt_matvec_norm_b3 'gt_matvec_b3_r1_s3$'; do
  timeout 60 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 70 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    $S bench --synthetic llama-3.1-8b --device cuda --quant rtn3 -p 0 -n 8 -r 1 --graphs off
  echo "[$(el)s] ncu $k rc=$?" >&2
done > $O/b1/ncu_rtn3_sections.txt 2>&1
grep -E "^\s+(Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible|Registers Per)" $O/b1/ncu_rtn3_sections.txt | head -40
tar czf $O/b1.tgz -C $O b1 && rm -rf $O/b1
echo "total $(el) s"
