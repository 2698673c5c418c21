#!/bin/bash
# Issue 15, third slice, call E: after call D, the selection histograms with one add per warp where the warp agrees and
# places its picks with ballots (no per-lane atomics on one bin, no bank-conflicted runs). Llama-3.1-8B shape:
# per-kernel times at 32K (graphs off), then tg128 at 4K, 32K and 131K with FP16 KV, 2/2 and
# 2/2 +4/+4 refined (groups of 2, 1/128), units in host memory and (@vram) in device memory.
set -u
mkdir -p /tmp/x && tar -xJf .gpu/bin.tar.xz -C /tmp/x
B=/tmp/x
$B/sfx test-backend --device cuda --op kvarn > $OUT/test_backend_kvarn.md 2>&1; echo "conformance rc=$?"; grep "cases on" $OUT/test_backend_kvarn.md
SFX_PROFILE_KERNELS=1 timeout 100 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 4 -r 1 \
  -d 32768 --kv 2/2+4/4 --graphs off > /dev/null 2> $OUT/profile.err; echo "profile rc=$?"
grep "kvarn" $OUT/profile.err
timeout 200 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 \
  -d 4096,32768 --kv f16,2/2,2/2+4/4,2/2+4/4@vram > $OUT/sfx_bench.md 2> $OUT/sfx_bench.err; echo "bench rc=$?"
cat $OUT/sfx_bench.md
timeout 240 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 1 \
  -d 131072 --kv f16,2/2,2/2+4/4,2/2+4/4@vram > $OUT/sfx_bench_131k.md 2> $OUT/sfx_bench_131k.err; echo "bench 131K rc=$?"
cat $OUT/sfx_bench_131k.md; tail -3 $OUT/sfx_bench_131k.err
