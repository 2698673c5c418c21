#!/bin/bash
# The landed build (final: new2 + one-wave tile sets where one block fills an SM): full
# conformance while llama.cpp builds, tg128 A/B against new2 (same kernels, one set a block),
# then llama.cpp Q2_K / Q4_K_M / Q4_0 and every sfx format back to back.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"
mkdir -p /tmp/final /tmp/new2
for b in final new2; do xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/final/sfx
t0=$(date +%s)
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/final PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
timeout 150 $S test-backend --device cuda > $O/test_backend_cuda.md 2>&1
grep "cases on cuda" $O/test_backend_cuda.md; grep -E "\| FAIL" $O/test_backend_cuda.md | head -5
echo "conformance $(( $(date +%s) - t0 )) s"
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
tg() { timeout 40 $1/sfx bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for q in rtn4 rtn2; do echo "$q tg128 final $(tg /tmp/final $q) $(tg /tmp/final $q) new2 $(tg /tmp/new2 $q) $(tg /tmp/new2 $q)"; done | tee $O/ab_sets.md
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=400 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
echo "total $(( $(date +%s) - t0 )) s"
