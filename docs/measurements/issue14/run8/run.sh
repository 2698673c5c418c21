#!/usr/bin/env bash
# One call: A = 49ae1a9's sfx, B = the tile launches' refinement scratch cut to the read-ahead
# regions where every refined operand is read ahead (3-bit gate/up: three blocks an SM instead
# of two at small k). B's conformance first, then per-kernel times and the 8B refined decode,
# builds alternating over two rounds.
set -uo pipefail
W=/tmp/ab; mkdir -p $W; xz -dc .gpu/ab.tar.xz | tar xf - -C $W
O=$W/out8; mkdir -p $O
trap 'tar czf $OUT/run8.tgz -C $W out8' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
timeout 100 $W/sfxB test-backend --device cuda --op refined --op lead --op model_decode \
  > $O/conformance_B.txt 2>&1
tail -2 $O/conformance_B.txt
grep -E "FAIL|fail" $O/conformance_B.txt | grep -v " 0 failed" | head -5
for b in A B; do
  SFX_PROFILE_KERNELS=1 $W/sfx$b bench --synthetic llama-3.1-8b --quant awq3 --fit --k 4 --s 1 \
    -p 0 -n 32 -r 1 --graphs off --device cuda > $O/profile_awq3_k4_s1_$b.md 2>&1
  grep -E "gt_swiglu_norm" $O/profile_awq3_k4_s1_$b.md | sed "s/^/$b /"
done
for round in 1 2; do
  for b in A B; do
    for q in awq3 rtn2; do
      $W/sfx$b bench --synthetic llama-3.1-8b --quant $q --fit --k 1,4,8 --s 1 -p 0 -n 128 -r 2 \
        --device cuda > $O/bench_${q}_s1_${b}_$round.md 2> /dev/null
      grep -E "^\| f16" $O/bench_${q}_s1_${b}_$round.md | sed "s/^/$q $b r$round /"
    done
  done
done
