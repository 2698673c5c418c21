#!/bin/bash
# Issue 13, twelfth slice, call F: llama.cpp builds in the background while the trellis and
# model-decode conformance run on the final build (final: call E's build with the popcount
# mixes left unstaged); then, on a quiet machine, tg128 of final against call E's build (mix),
# and llama.cpp Q2_K / Q4_K_M / Q4_0 beside every sfx 2/3/4-bit format on the faster one.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in mix final; do mkdir -p /tmp/$b; xz -dc .gpu/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done
setsid bash -c "QUANTS='q2_k q4_k_m q4_0' DEADLINE=0 OUT=/tmp/peerprep bash .peers/llamacpp/device_bench.sh" > /tmp/peerprep.log 2>&1 < /dev/null &
timeout 150 /tmp/final/sfx test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep FAIL $O/test_backend_trellis.md | head -5
ok=$(grep -c '95 passed, 0 failed' $O/test_backend_trellis.md)
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"; tail -2 /tmp/peerprep.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
tg() { timeout 60 $1 bench $M --quant $2 -p 0 -n 128 -r 3 "${@:3}" 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}' | tr '\n' ' '; }
for round in 1 2; do
  for f in qtip2:hyb qtip4:hyb; do
    code=(--trellis-code "${f##*:}"); q=${f%%:*}
    echo "$f r$round mix $(tg /tmp/mix/sfx $q "${code[@]}") final $(tg /tmp/final/sfx $q "${code[@]}")"
  done
done | tee $O/ab_final.md
pick=$(awk '/^qtip2:hyb/ {for (i=1;i<=NF;i++) if ($i=="mix") {a+=$(i+1)} else if ($i=="final") {b+=$(i+1)}} END {print (b>=a) ? "final" : "mix"}' $O/ab_final.md)
[ "$ok" = 1 ] || pick=mix
echo "side by side on $pick"; S=/tmp/$pick/sfx
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=300 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $9, $10, $11}'
echo "total $(( $(date +%s) - t0 )) s"
