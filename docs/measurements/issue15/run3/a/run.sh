#!/bin/bash
# Issue 15, third slice, call A on the H200: KVarN conformance (with refinement) and the
# Llama-3.1-8B-shape decode bench at 4K and 32K with FP16 KV, 2/2, 3/2 and 2/2 +4/+4 refined
# (groups of 2, 1/128), all in one process. Binaries built on the dev machine (sm_90), carried.
set -u
mkdir -p .gpu/x && tar -xJf .gpu/bin.tar.xz -C .gpu/x
B=.gpu/x
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
$B/sfx test-backend --device cuda --op kvarn > $OUT/test_backend_kvarn.md 2>&1; echo "conformance rc=$?"
grep "cases on" $OUT/test_backend_kvarn.md
timeout 420 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 3 \
  -d 4096,32768 --kv f16,2/2,3/2,2/2+4/4 --kv-group 2 --kv-fraction 1/128 \
  > $OUT/sfx_bench.md 2> $OUT/sfx_bench.err; echo "bench rc=$?"
cat $OUT/sfx_bench.md; tail -5 $OUT/sfx_bench.err
