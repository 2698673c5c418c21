#!/bin/bash
# Batched row-mix loads in the trellis transforms: full conformance, ncu durations of the
# transform kernels (old vs new), tg128 A/B, then llama.cpp beside every format (final table).
B=$PWD/.gpu/bin; O=$OUT
mkdir -p /tmp/new /tmp/old; cp $B/sfx /tmp/new/sfx; cp $B/sfx_prev /tmp/old/sfx; S=/tmp/new/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/new PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
timeout 200 $S test-backend --device cuda > $O/test_backend_cuda.md 2>&1
grep "cases on cuda" $O/test_backend_cuda.md; grep -E "\| FAIL" $O/test_backend_cuda.md | head -5
echo "conformance $(( $(date +%s) - t0 )) s"
for b in old new; do
  timeout 100 ncu --clock-control none --cache-control none --kernel-name regex:'tr_prepare|tr_finish' --launch-skip 40 --launch-count 8 \
    --metrics gpu__time_duration.sum /tmp/$b/sfx bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off 2>&1 \
    | grep -E "^  tr_|duration" | paste - - | awk -v b=$b '{print b, $1, $2, $(NF)}'
done | tee $O/ncu_transforms.txt
echo "ncu $(( $(date +%s) - t0 )) s"
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
tg() { timeout 60 $1/sfx bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}'; }
for q in qtip2 qtip4; do
  echo "$q tg128 new $(tg /tmp/new $q) $(tg /tmp/new $q) old $(tg /tmp/old $q) $(tg /tmp/old $q)"
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
