#!/bin/bash
# Issue 15, fourth slice, call H, right after call G on the warm machine: the SmolLM2 agreement
# again with nothing else running (in call G it ran beside llama.cpp's build, which held the host
# CPUs its CPU reference needs, and timed out after two of its six cases).
S=/tmp/s; mkdir -p /tmp/agree2
SFX_ASSETS=$S SFX_AGREEMENT_OUT=/tmp/agree2 SFX_REPO=$PWD timeout 110 /tmp/x/cuda_agreement kvarn > $OUT/agreement_kvarn.txt 2>&1
echo "rc=$?"; tar -cf $OUT/agreement_json.tar -C /tmp/agree2 .
grep -E "^test |result|KL" $OUT/agreement_kvarn.txt | tail -12
