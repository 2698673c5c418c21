#!/bin/bash
# Issue 15, third slice, call B: SmolLM2 CUDA-vs-CPU agreement of the device KVarN cache, alone
# and refined; per-kernel times of one refined decode step at 32K (graphs off).
set -u
# (Call B0 before it, with .gpu and .gpuA carried: mkdir -p /tmp/x /tmp/s; tar -xJf .gpu/bin.tar.xz -C /tmp/x; cp .gpuA/gguf.part.aa /tmp/s/ — the device keeps /tmp between warm calls.)
B=/tmp/x
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null; ls /tmp/s
SFX_ASSETS=/tmp/s SFX_AGREEMENT_OUT=$OUT SFX_REPO=$PWD timeout 250 $B/cuda_agreement kvarn > $OUT/agreement_kvarn.txt 2>&1
echo "agreement rc=$?"; tail -12 $OUT/agreement_kvarn.txt
SFX_PROFILE_KERNELS=1 timeout 200 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 8 -r 1 \
  -d 32768 --kv 2/2,2/2+4/4 --graphs off > $OUT/profile.md 2> $OUT/profile.err; echo "profile rc=$?"
grep -i "kvarn\|kernel" $OUT/profile.err | head -40
