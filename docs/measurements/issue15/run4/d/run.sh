#!/bin/bash
# Issue 15, fourth slice, call D, right after call C on the warm machine (build D: binaries and
# the first GGUF part in /tmp): SmolLM2 CUDA-vs-CPU agreement of the device KVarN cache, alone and
# refined, and the austen-long:8192 KV sweep on CUDA. kvarn_3_2 failed its bound here (KL 5.7e-4
# against 3.0e-4): the attention's hoisted sums cancelled (conformance error 1e-6 → 2.5e-6 on the
# long layers); call E's build centres the codes. kvarn_3_3.json did not come back (file count).
set -u
cp .gpuB/gguf.part.ab .gpuB/gguf.part.ac /tmp/s/ 2>/dev/null
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null; ls /tmp/s
SFX_ASSETS=/tmp/s SFX_AGREEMENT_OUT=$OUT SFX_REPO=$PWD timeout 250 /tmp/x/cuda_agreement kvarn > $OUT/agreement_kvarn.txt 2>&1
echo "agreement rc=$?"; tail -12 $OUT/agreement_kvarn.txt
SFX_ASSETS=/tmp/s timeout 200 /tmp/x/sfx-run /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \
  --ppl austen-long:8192 --kv f16,2/2,3/2,3/3,2/1 --kv-refine auto --kv-group 2 --kv-fraction 1/128 \
  --json > $OUT/kv_sweep_cuda.json 2> $OUT/kv_sweep_cuda.err; echo "sweep rc=$?"
grep -E "PPL" $OUT/kv_sweep_cuda.err | tail -12
