#!/bin/bash
# Issue 14, first slice, call G, right after call F: call E's agreement failed (mean KL 6.6e-3
# prefill, 1.4e-3 decode); the same test with one set refined at a time, and with none (k = 0:
# the refined layer's resident path alone, its gate and up now one fused-norm group).
set -u
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null
for k in 0,0,0,0 16,0,0,0 0,16,0,0 0,0,16,0 0,0,0,16; do
  SFX_AGREEMENT_K=$k SFX_ASSETS=/tmp/s SFX_CONVERT=/tmp/x/sfx-convert SFX_AGREEMENT_OUT=$OUT SFX_REPO=$PWD timeout 100 \
    /tmp/x/cuda_agreement fit_refined > $OUT/agreement_k$k.txt 2>&1
  echo "k=$k rc=$?"; grep -o '"mean_kl_cpu_cuda":[^,]*\|"decode_mean_kl_cpu_cuda":[^,]*\|"mean_kl_refined_vs_base_cpu":[^,]*' $OUT/agreement_k$k.txt | tr '\n' ' '; echo
done
