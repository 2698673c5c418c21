#!/bin/bash
# Trellis prefill: transforms one block per token (vector in shared memory) and 64/128-token
# GEMM blocks. Trellis conformance (default, and every prefill on 128-token blocks), pp512 A/B
# in one binary (SFX_TR_TOKEN_TRANSFORMS=0: the row blocks; SFX_TR_GEMM_TOKENS) and against the
# GEMM-only build, then a per-kernel profile.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in gemm tok; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/tok/sfx
timeout 200 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
SFX_TR_GEMM_TOKENS=128 timeout 200 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis_t128.md 2>&1
for f in $O/test_backend_trellis*.md; do echo "$(basename $f): $(grep 'cases on cuda' $f)"; grep -E "FAIL" $f | head -5; done
echo "conformance $(( $(date +%s) - t0 )) s"
pp() { timeout 60 env $1 $2 bench $M --quant $3 "${@:4}" -p 512 -n 0 -r 3 2>&1 | grep pp512 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for f in qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(--trellis-code "${f##*:}"); q=${f%%:*}
  echo "$f pp512 t128 $(pp SFX_TR_GEMM_TOKENS=128 $S $q "${code[@]}") t64 $(pp SFX_TR_GEMM_TOKENS=64 $S $q "${code[@]}") rows $(pp SFX_TR_TOKEN_TRANSFORMS=0 $S $q "${code[@]}") gemm_build $(pp X=1 /tmp/gemm/sfx $q "${code[@]}")"
done | tee $O/ab_prefill.md
SFX_PROFILE_KERNELS=1 timeout 120 $S bench $M --quant qtip2 -p 512 -n 0 -r 1 --graphs off > /dev/null 2> $O/profile_pp_qtip2.err
echo "total $(( $(date +%s) - t0 )) s"
