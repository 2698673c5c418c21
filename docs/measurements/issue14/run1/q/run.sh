#!/bin/bash
# Issue 14, first slice, call Q, right after call P: the review build's SmolLM2 agreement test of
# refined decoding (awq3 --fit): the decode path with the attention sets and with the MLP sets
# against the strict bound, then every set at k = 16 against the float model on both backends.
set -u
test -s /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf || cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
test -d /tmp/s/wiki || { tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null; }
SFX_ASSETS=/tmp/s SFX_CONVERT=/tmp/x/sfx-convert SFX_AGREEMENT_OUT=$OUT SFX_REPO=$PWD timeout 300 \
  /tmp/x/cuda_agreement fit_refined > $OUT/agreement_refined.txt 2>&1
echo "agreement rc=$?"; grep -E "^test |result" $OUT/agreement_refined.txt; cat $OUT/*.json
