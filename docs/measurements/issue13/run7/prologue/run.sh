#!/bin/bash
# Trellis prologue (two-pass transform, x read once, batched table loads): conformance, A/B
# against the previous build, ncu durations of the matvecs; llama.cpp beside every format.
B=$PWD/.gpu/bin; O=$OUT
mkdir -p /tmp/new /tmp/old; cp $B/sfx /tmp/new/sfx; cp $B/sfx_prev /tmp/old/sfx; S=/tmp/new/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/new PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
for op in trellis_linear trellis_projections trellis_swiglu model_decode rope_attention; do
  timeout 120 $S test-backend --device cuda --op $op > /tmp/tb_$op.md 2>&1
  echo "$op: $(grep 'cases on cuda' /tmp/tb_$op.md)"; grep -E "\| FAIL" /tmp/tb_$op.md | head -5
done
cat /tmp/tb_*.md > $O/test_backend_ops.md
echo "conformance $(( $(date +%s) - t0 )) s"
for b in old new; do
  timeout 100 ncu --clock-control none --cache-control none --kernel-name regex:tr_matvec --launch-skip 40 --launch-count 4 \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum /tmp/$b/sfx bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off 2>&1 \
    | grep -E "duration|inst_executed" | awk -v b=$b '{print b, $1, $3}'
done | tee $O/ncu_matvec.txt
echo "ncu $(( $(date +%s) - t0 )) s"
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
tg() { timeout 60 $1/sfx bench $M --quant $2 $3 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}'; }
for f in "qtip2" "qtip2 --trellis-code=1mad" "qtip4"; do
  q=${f%% *}; c=""; [ "$f" != "$q" ] && c=${f#* }
  echo "$f tg128 new $(tg /tmp/new $q "$c") $(tg /tmp/new $q "$c") old $(tg /tmp/old $q "$c") $(tg /tmp/old $q "$c")"
done | tee $O/ab.md
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=400 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 120 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
SFX_PROFILE_KERNELS=1 timeout 100 $S bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2.err
grep -E '^\| ' $O/profile_qtip2.err | head -14
echo "total $(( $(date +%s) - t0 )) s"
