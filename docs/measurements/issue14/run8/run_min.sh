#!/usr/bin/env bash
# The short form of run.sh for the device time left: B's refined conformance, then the 8B
# refined decode of A and B (awq3, then rtn2), written straight to $OUT as each finishes.
set -uo pipefail
W=/tmp/ab; mkdir -p $W; xz -dc .gpu/ab.tar.xz | tar xf - -C $W
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 60 $W/sfxB test-backend --device cuda --op refined --op model_decode > $OUT/conformance_B.txt 2>&1
tail -1 $OUT/conformance_B.txt
for q in awq3 rtn2; do
  for b in A B; do
    $W/sfx$b bench --synthetic llama-3.1-8b --quant $q --fit --k 1,4 --s 1 -p 0 -n 128 -r 2 \
      --device cuda > $OUT/bench_${q}_${b}.md 2> /dev/null
    grep -E "^\| f16" $OUT/bench_${q}_${b}.md | sed "s/^/$q $b /"
  done
done
