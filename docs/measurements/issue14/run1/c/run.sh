#!/bin/bash
# Issue 14, first slice, call C, right after call B on the warm machine (build B in /tmp): the
# SmolLM2 CUDA-vs-CPU agreement of refined decoding — an awq3 --fit file converted here by this
# build, refined at k = 16 (ram tier) by the CPU's host-driven engine and CUDA's engine in the
# backend. It failed at the conversion: the default calibration corpus (brown) was not on the
# device; the next build converts with --calib wiki (call E).
set -u
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null; ls /tmp/s
SFX_ASSETS=/tmp/s SFX_CONVERT=/tmp/x/sfx-convert SFX_AGREEMENT_OUT=$OUT SFX_REPO=$PWD timeout 400 \
  /tmp/x/cuda_agreement fit_refined > $OUT/agreement_refined.txt 2>&1
echo "agreement rc=$?"; tail -8 $OUT/agreement_refined.txt; cat $OUT/*.json 2>/dev/null | head -40
