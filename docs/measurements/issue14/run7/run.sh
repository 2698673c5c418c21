#!/usr/bin/env bash
# One call: A = 49ae1a9's sfx, B = the same with the one-tile `_rf` tile entries held to three
# blocks an SM (__launch_bounds__(256, 3)). Per-kernel times (graphs off), then refined decode
# on the 8B shape, alternating builds over two rounds, then B's refinement conformance.
set -uo pipefail
W=/tmp/ab; mkdir -p $W; xz -dc .gpu/ab.tar.xz | tar xf - -C $W
O=$W/out; mkdir -p $O
trap 'tar czf $OUT/run7.tgz -C $W out' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for b in A B; do
  SFX_PROFILE_KERNELS=1 $W/sfx$b bench --synthetic llama-3.1-8b --quant awq3 --fit --k 4 --s 1 \
    -p 0 -n 32 -r 1 --graphs off --device cuda > $O/profile_awq3_k4_s1_$b.md 2>&1
done
for round in 1 2; do
  for b in A B; do
    for q in awq3 rtn2; do
      $W/sfx$b bench --synthetic llama-3.1-8b --quant $q --fit --k 1,4,16 --s 1 -p 0 -n 128 -r 2 \
        --device cuda > $O/bench_${q}_s1_${b}_$round.md 2> /dev/null
      grep -E "^\| f16" $O/bench_${q}_s1_${b}_$round.md | sed "s/^/$q $b r$round /"
    done
  done
done
timeout 240 $W/sfxB test-backend --device cuda --op group --op refined --op lead > $O/conformance_B.txt 2>&1
tail -3 $O/conformance_B.txt
