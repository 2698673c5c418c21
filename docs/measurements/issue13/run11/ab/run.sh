#!/bin/bash
# Issue 13, eleventh slice, call 1: llama.cpp builds in the background while the trellis
# conformance runs on both candidate builds (c16: 16 table copies, one-LOP3 address, K=2 word
# windows; c32: 32 copies, same windows) and the tg128 A/B against the landed build (base);
# then llama.cpp Q2_K / Q4_K_M / Q4_0 beside every sfx format on the faster candidate.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in base c16 c32; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/c16 PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
for b in c16 c32; do
  timeout 120 /tmp/$b/sfx test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis_$b.md 2>&1
  echo "$b: $(grep 'cases on cuda' $O/test_backend_trellis_$b.md)"; grep -E "FAIL" $O/test_backend_trellis_$b.md | head -5
done
echo "conformance $(( $(date +%s) - t0 )) s"
tg() { timeout 60 $1 bench $M --quant $2 "${@:3}" -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for f in qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(--trellis-code "${f##*:}"); q=${f%%:*}
  for round in 1 2; do
    echo "$f r$round base $(tg /tmp/base/sfx $q "${code[@]}") c16 $(tg /tmp/c16/sfx $q "${code[@]}") c32 $(tg /tmp/c32/sfx $q "${code[@]}")"
  done
done | tee $O/ab_decode.md
for b in base c16 c32; do
  SFX_PROFILE_KERNELS=1 timeout 60 /tmp/$b/sfx bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2_$b.err
  echo "$b: $(grep -E 'tr_matvec' $O/profile_qtip2_$b.err | head -1)"
done
echo "ab $(( $(date +%s) - t0 )) s"
# The faster candidate on qtip2 HYB (sum of its tg128 rows) runs the side by side.
pick=$(awk '/^qtip2:hyb/ {for (i=1;i<=NF;i++) if ($i=="c16") {a+=$(i+1)+$(i+2)+$(i+3)} else if ($i=="c32") {b+=$(i+1)+$(i+2)+$(i+3)}} END {print (a>=b) ? "c16" : "c32"}' $O/ab_decode.md)
echo "side by side on $pick"; S=/tmp/$pick/sfx
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=300 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
echo "total $(( $(date +%s) - t0 )) s"
