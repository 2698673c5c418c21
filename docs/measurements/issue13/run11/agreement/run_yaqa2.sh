#!/bin/bash
# Issue 13, eleventh slice: the SmolLM2 yaqa2 file on CUDA vs CPU with the landed code
# (cuda_agreement's trellis case: prefill through the tensor-core trellis GEMM and token
# transforms, decode through the matvecs), after two calls that left the file in two halves
# and the wiki text in /tmp/agree.
O=$OUT; t0=$(date +%s)
cat /tmp/agree/yaqa2.part00 /tmp/agree/yaqa2.part01 > /tmp/agree/yaqa2-head-q8.sfx
echo "$(md5sum < /tmp/agree/yaqa2-head-q8.sfx | cut -d' ' -f1) vs $(cut -d' ' -f1 .gpu/yaqa2.md5)"
mkdir -p /tmp/agree/assets/wiki; xz -dc /tmp/agree/wiki.json.xz > /tmp/agree/assets/wiki/summaries_en-us.json
xz -dc .gpu/xz/agr.xz > /tmp/agree/agr; chmod +x /tmp/agree/agr
SFX_REPO=$PWD SFX_ASSETS=/tmp/agree/assets SFX_AGREEMENT_SFX=/tmp/agree SFX_AGREEMENT_OUT=$O timeout 300 /tmp/agree/agr --exact cuda::smollm2_sfx::yaqa2 > $O/agreement_yaqa2.txt 2>&1
tail -5 $O/agreement_yaqa2.txt; cat $O/*.json 2>/dev/null | head -30
echo "total $(( $(date +%s) - t0 )) s"
# The review build of the KVarN op (score and value accumulation written once), its conformance
# beside the float attention ops.
mkdir -p /tmp/kv2; xz -dc .gpu/xz/kv2.xz > /tmp/kv2/sfx; chmod +x /tmp/kv2/sfx
timeout 120 /tmp/kv2/sfx test-backend --device cuda --op kvarn_attention --op attention > $O/test_backend_kvarn_review.md 2>&1
echo "kvarn review: $(grep 'cases on cuda' $O/test_backend_kvarn_review.md)"; grep FAIL $O/test_backend_kvarn_review.md | head -3
echo "total $(( $(date +%s) - t0 )) s"
