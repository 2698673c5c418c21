#!/bin/bash
# Issue 14, first slice, call I, right after call H: call G found every set alone within the
# decode bound but all four together at 1.4e-3; pairs of sets, and all four with the branches
# off (SFX_BRANCHES=0: each set's selection and gather in order on the main stream).
set -u
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null
for v in 1:16,16,16,16 0:16,16,16,16 1:16,16,0,0 1:0,0,16,16 1:16,0,0,16; do
  br=${v%%:*}; k=${v#*:}
  SFX_BRANCHES=$br SFX_AGREEMENT_K=$k SFX_ASSETS=/tmp/s SFX_CONVERT=/tmp/x/sfx-convert SFX_AGREEMENT_OUT=/tmp/ag SFX_REPO=$PWD timeout 100 \
    /tmp/x/cuda_agreement fit_refined > /tmp/ag_$br_$k.txt 2>&1
  echo "branches=$br k=$k rc=$?"; grep -o '"mean_kl_cpu_cuda":[^,]*\|"decode_mean_kl_cpu_cuda":[^,]*\|"decode_max_abs_logit_diff":[^,]*' /tmp/ag_$br_$k.txt | tr '\n' ' '; echo
done
