#!/bin/bash
# Issue 15, fourth slice, call A. Two builds: A = the selection spread over many blocks per KV
# head (scoring blocks + last-block radix select) and correction blocks of 16 groups; B = A plus
# the attention launch with the affine terms hoisted out of its inner loops and one-word code
# reads. Conformance of both, per-kernel times at 32K (graphs off), tg128 side by side in one
# process per build, and ncu of B's KVarN launches at 32K.
set -u
mkdir -p /tmp/x && tar -xJf .gpu/bin.tar.xz -C /tmp/x
for b in A B; do
  echo "## build $b" >> $OUT/test_backend.md
  /tmp/x/$b/sfx test-backend --device cuda --op kvarn >> $OUT/test_backend.md 2>&1; echo "conformance $b rc=$?"
done
grep "cases on" $OUT/test_backend.md
for b in A B; do
  echo "## build $b" >> $OUT/profile.txt
  SFX_PROFILE_KERNELS=1 timeout 100 /tmp/x/$b/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
    -d 32768 --kv 2/2+4/4 --graphs off > /dev/null 2>> $OUT/profile.txt; echo "profile $b rc=$?"
  SFX_PROFILE_KERNELS=1 timeout 100 /tmp/x/$b/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
    -d 32768 --kv 2/2 --graphs off > /dev/null 2>> $OUT/profile.txt; echo "profile 2/2 $b rc=$?"
done
grep -E "build|kvarn" $OUT/profile.txt
timeout 220 /tmp/x/B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 \
  -d 4096,32768 --kv f16,2/2,2/2+4/4,2/2+4/4@vram > $OUT/bench_B.md 2> $OUT/bench_B.err; echo "bench B rc=$?"
cat $OUT/bench_B.md
timeout 120 /tmp/x/A/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 \
  -d 32768 --kv 2/2,2/2+4/4 > $OUT/bench_A.md 2>> $OUT/bench_B.err; echo "bench A rc=$?"
cat $OUT/bench_A.md
timeout 150 ncu --clock-control none -k regex:kvarn -c 8 /tmp/x/B/sfx bench --synthetic llama-3.1-8b --device cuda \
  --quant rtn4 -p 0 -n 2 -r 1 -d 32768 --kv 2/2+4/4 --graphs off > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "kvarn_|Duration|Issued Warp|Achieved Occupancy|Memory Throughput" $OUT/ncu.txt | head -60
