#!/bin/bash
# One call: llama.cpp builds in the background while the trellis conformance (default, and every
# prefill on 128-token GEMM blocks) and the pp512 A/B run (register-tiled token transforms vs the
# row blocks, and the GEMM-only build); then the side by side: llama.cpp Q2_K / Q4_K_M / Q4_0 and
# every sfx format, pp512 and tg128.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in gemm tok; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/tok/sfx
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/tok PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
timeout 100 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
SFX_TR_GEMM_TOKENS=128 timeout 100 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis_t128.md 2>&1
for f in $O/test_backend_trellis*.md; do echo "$(basename $f): $(grep 'cases on cuda' $f)"; grep -E "FAIL" $f | head -5; done
pp() { timeout 60 env $1 $2 bench $M --quant $3 "${@:4}" -p 512 -n 0 -r 3 2>&1 | grep pp512 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for f in qtip2:hyb qtip2:3inst; do
  code=(--trellis-code "${f##*:}"); q=${f%%:*}
  echo "$f pp512 new $(pp X=1 $S $q "${code[@]}") rows $(pp SFX_TR_TOKEN_TRANSFORMS=0 $S $q "${code[@]}") gemm_build $(pp X=1 /tmp/gemm/sfx $q "${code[@]}")"
done | tee $O/ab_prefill.md
SFX_PROFILE_KERNELS=1 timeout 60 $S bench $M --quant qtip2 -p 512 -n 0 -r 1 --graphs off > /dev/null 2> $O/profile_pp_qtip2.err
grep -E "tokens|tr_gemm" $O/profile_pp_qtip2.err | head -6
echo "ab $(( $(date +%s) - t0 )) s"
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=300 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
echo "total $(( $(date +%s) - t0 )) s"
