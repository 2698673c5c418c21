#!/bin/bash
# Issue 13, eleventh slice, call 2 (after two calls that left the qtip2 .sfx in two halves and
# the wiki text in /tmp/agree): the SmolLM2 qtip2 file on CUDA vs CPU (cuda_agreement's trellis
# case: prefill through the tensor-core trellis GEMM and token transforms, decode through the
# matvecs) with the landed build.
O=$OUT; t0=$(date +%s)
cat /tmp/agree/qtip2.part00 /tmp/agree/qtip2.part01 > /tmp/agree/qtip2-head-q8.sfx
echo "$(md5sum < /tmp/agree/qtip2-head-q8.sfx | cut -d' ' -f1) vs $(cut -d' ' -f1 .gpu/qtip2.md5)"
mkdir -p /tmp/agree/assets/wiki; xz -dc /tmp/agree/wiki.json.xz > /tmp/agree/assets/wiki/summaries_en-us.json
xz -dc .gpu/xz/agr.xz > /tmp/agree/agr; chmod +x /tmp/agree/agr
SFX_REPO=$PWD SFX_ASSETS=/tmp/agree/assets SFX_AGREEMENT_SFX=/tmp/agree SFX_AGREEMENT_OUT=$O timeout 300 /tmp/agree/agr --exact cuda::smollm2_sfx::qtip2 > $O/agreement_qtip2.txt 2>&1
tail -5 $O/agreement_qtip2.txt; cat $O/*.json 2>/dev/null | head -30
echo "total $(( $(date +%s) - t0 )) s"
