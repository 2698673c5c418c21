#!/bin/bash
# Issue 15, fourth slice, call B. Build C = call A's build B plus a correction launch that
# stages its selections in shared memory before issuing every unit read at once, takes 8
# groups a block, and rotates all output rows with one barrier a span. Conformance, per-kernel
# times at 32K (graphs off), tg128 at 32K in one process, and ncu of the KVarN launches:
# warp-state statistics, then per-SASS-instruction stall samples.
set -u
mkdir -p /tmp/x && tar -xJf .gpu/bin.tar.xz -C /tmp/x
B=/tmp/x/C/sfx
$B test-backend --device cuda --op kvarn > $OUT/test_backend.md 2>&1; echo "conformance rc=$?"; grep "cases on" $OUT/test_backend.md
SFX_PROFILE_KERNELS=1 timeout 100 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
  -d 32768 --kv 2/2+4/4 --graphs off > /dev/null 2> $OUT/profile.txt; echo "profile rc=$?"
grep kvarn $OUT/profile.txt
timeout 150 $B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 \
  -d 32768 --kv f16,2/2,2/2+4/4,2/2+4/4@vram > $OUT/bench.md 2> $OUT/bench.err; echo "bench rc=$?"
cat $OUT/bench.md
CMD="$B bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 1 -r 1 -d 32768 --kv 2/2+4/4 --graphs off"
timeout 120 ncu --clock-control none -k regex:kvarn_refine -c 2 --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section SpeedOfLight $CMD > $OUT/ncu_stats.txt 2>&1; echo "ncu stats rc=$?"
grep -E "^  kvarn|Stall|Issued|Eligible|Active Warps|Duration|Warp Cycles" $OUT/ncu_stats.txt | head -60
timeout 150 ncu --clock-control none -k regex:"kvarn_(refine|attn_decode)" -c 3 --section SourceCounters --page source \
  --csv --print-source sass $CMD > $OUT/ncu_source.csv 2>&1; echo "ncu source rc=$?"
wc -l $OUT/ncu_source.csv; head -3 $OUT/ncu_source.csv | cut -c1-600
