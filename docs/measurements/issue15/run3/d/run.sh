#!/bin/bash
# Issue 15, third slice, call D: after call C's profile, the selection keeps its scores in
# shared memory and the correction fetches all its units in one pass. Llama-3.1-8B shape:
# per-kernel times at 32K (graphs off), then tg128 at 4K, 32K and 131K with FP16 KV, 2/2 and
# 2/2 +4/+4 refined (groups of 2, 1/128), one process per depth set.
set -u
mkdir -p /tmp/x && tar -xJf .gpu/bin.tar.xz -C /tmp/x
B=/tmp/x
$B/sfx test-backend --device cuda --op kvarn > $OUT/test_backend_kvarn.md 2>&1; echo "conformance rc=$?"; grep "cases on" $OUT/test_backend_kvarn.md
SFX_PROFILE_KERNELS=1 timeout 120 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 8 -r 1 \
  -d 32768 --kv 2/2,2/2+4/4 --graphs off > /dev/null 2> $OUT/profile.err; echo "profile rc=$?"
grep "kvarn" $OUT/profile.err
timeout 200 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 3 \
  -d 4096,32768 --kv f16,2/2,2/2+4/4 > $OUT/sfx_bench.md 2> $OUT/sfx_bench.err; echo "bench rc=$?"
cat $OUT/sfx_bench.md
timeout 240 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 \
  -d 131072 --kv f16,2/2,2/2+4/4 > $OUT/sfx_bench_131k.md 2> $OUT/sfx_bench_131k.err; echo "bench 131K rc=$?"
cat $OUT/sfx_bench_131k.md; tail -3 $OUT/sfx_bench_131k.err
