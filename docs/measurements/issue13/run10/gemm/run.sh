#!/bin/bash
# Trellis prefill GEMM (tiles decoded into MMA fragments for 64 tokens; no f32 panel):
# trellis conformance on the new build, then pp512 A/B against the landed build, and a profile.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in ow gemm; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/gemm/sfx
timeout 200 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_trellis.md | tr '\n' ' ') $(( $(date +%s) - t0 )) s"
grep -E "FAIL" $O/test_backend_trellis.md | head -8
pp() { timeout 60 $1 bench $M --quant $2 "${@:3}" -p 512 -n 0 -r 3 2>&1 | grep pp512 | awk -F'|' '{print $9}' | awk '{print $1}'; }
for f in qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(--trellis-code "${f##*:}")
  echo "$f pp512 new $(pp $S ${f%%:*} "${code[@]}") old $(pp /tmp/ow/sfx ${f%%:*} "${code[@]}")"
done | tee $O/ab_prefill.md
SFX_PROFILE_KERNELS=1 timeout 120 $S bench $M --quant qtip2 -p 512 -n 0 -r 1 --graphs off > /dev/null 2> $O/profile_pp_qtip2.err
echo "total $(( $(date +%s) - t0 )) s"
