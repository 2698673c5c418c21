#!/bin/bash
# Side by side on the machine run20 left warm: llama.cpp Q2_K / Q4_K_M / Q4_0 and every sfx
# format back to back, with the configuration run20 chose (its env in /tmp/chosen_env).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/ow; [ -x /tmp/ow/sfx ] || { xz -dc .gpu/xz/ow.xz > /tmp/ow/sfx; chmod +x /tmp/ow/sfx; }; S=/tmp/ow/sfx
E=$(cat /tmp/chosen_env 2>/dev/null || echo X=1); echo "env $E" | tee $O/chosen.txt
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/ow PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=400 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 env $E $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
# Q4_0 once more after our rows: its spread decides the 1.3x floor.
QUANTS="q4_0" ARGS="-p 0 -n 128 -r 5 -fa 1" DEADLINE=120 OUT=/tmp/q40 bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
cp /tmp/q40/llamacpp_bench.md $O/llamacpp_q4_0_after.md 2>/dev/null; grep tg128 $O/llamacpp_q4_0_after.md | awk -F'|' '{print $2, $8, $9}'
echo "total $(( $(date +%s) - t0 )) s"
