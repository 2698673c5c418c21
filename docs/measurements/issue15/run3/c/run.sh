#!/bin/bash
# Issue 15, third slice, call C (after C0, carrying .gpu and .gpuA: mkdir -p /tmp/x /tmp/s;
# tar -xJf .gpu/bin.tar.xz -C /tmp/x; cp .gpuA/gguf.part.aa /tmp/s/ — /tmp survives between
# warm calls). Merge and selection reworked after call B's profile.
#  1. SmolLM2 austen-long:8192 KV sweep on CUDA: every base alone and refined (+4/+4, +0/+1 for
#     2/1; groups of 2; 1/128) — the CPU's numbers are docs/results.md's KV table 1.
#  2. Llama-3.1-8B shape decode at 4K and 32K: FP16 KV, 2/2, 3/2, 2/2 +4/+4, 3/2 +4/+4.
#  3. Per-kernel times of the same at 32K, graphs off.
set -u
B=/tmp/x
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && cp -r /tmp/s/assets/* /tmp/s/
SFX_ASSETS=/tmp/s timeout 200 $B/sfx-run /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \
  --ppl austen-long:8192 --kv f16,2/2,3/2,3/3,2/1 --kv-refine auto --kv-group 2 --kv-fraction 1/128 \
  --json > $OUT/kv_sweep_cuda.json 2> $OUT/kv_sweep_cuda.err; echo "sweep rc=$?"
grep -E "PPL" $OUT/kv_sweep_cuda.err | tail -12
timeout 240 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 3 \
  -d 4096,32768 --kv f16,2/2,3/2,2/2+4/4,3/2+4/4 > $OUT/sfx_bench.md 2> $OUT/sfx_bench.err; echo "bench rc=$?"
cat $OUT/sfx_bench.md
SFX_PROFILE_KERNELS=1 timeout 120 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 8 -r 1 \
  -d 32768 --kv 2/2,2/2+4/4 --graphs off > /dev/null 2> $OUT/profile.err; echo "profile rc=$?"
grep "kvarn" $OUT/profile.err
