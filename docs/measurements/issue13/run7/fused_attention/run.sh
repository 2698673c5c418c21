#!/bin/bash
# Fused rope + KV write + attention: full conformance, then llama.cpp vs every format (fused),
# and an A/B of SFX_FUSED_ATTN=0 on rtn2 / rtn4 / qtip2 (same binary).
B=$PWD/.gpu/bin; O=$OUT
mkdir -p /tmp/bin; cp $B/sfx /tmp/bin/sfx; S=/tmp/bin/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/bin PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
timeout 200 $S test-backend --device cuda > $O/test_backend_cuda.md 2>&1
grep "cases on cuda" $O/test_backend_cuda.md; grep -E "\| FAIL|failed \|" $O/test_backend_cuda.md | head
grep -E "rope_attention" $O/test_backend_cuda.md | awk -F'|' '{print $3, $5}' | head -24 | tr '\n' ';'; echo
echo "conformance $(( $(date +%s) - t0 )) s"
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=400 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
echo "peer $(( $(date +%s) - t0 )) s"
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 120 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
echo "ours $(( $(date +%s) - t0 )) s"
tg() { timeout 60 env $2 $S bench $M --quant $1 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}'; }
for q in rtn4 rtn2 qtip2; do
  a1=$(tg $q SFX_FUSED_ATTN=1); b1=$(tg $q SFX_FUSED_ATTN=0); a2=$(tg $q SFX_FUSED_ATTN=1); b2=$(tg $q SFX_FUSED_ATTN=0)
  echo "$q tg128 fused $a1 $a2 unfused $b1 $b2"
done | tee $O/ab.md
echo "total $(( $(date +%s) - t0 )) s"
