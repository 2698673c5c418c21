#!/bin/bash
# Issue 13, eleventh slice, call 3: the landed build (fin) beside llama.cpp Q2_K / Q4_K_M / Q4_0
# in one call: pp512 and tg128 of every sfx 2/4-bit group and trellis format.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/fin; xz -dc .gpu/xz/fin.xz > /tmp/fin/sfx; chmod +x /tmp/fin/sfx; S=/tmp/fin/sfx
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/fin PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
timeout 100 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "fin: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep -E "FAIL" $O/test_backend_trellis.md | head -5
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=300 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
echo "total $(( $(date +%s) - t0 )) s"
