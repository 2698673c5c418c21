#!/bin/bash
# Call C: issue 13's side-by-side in one command, with rtn3/awq3 on the 3-bit tiles: llama.cpp
# (0c1e570, Q2_K / Q4_K_M / Q4_0) and every sfx format on the 8B shape, tg128 and pp512,
# back to back on a quiet machine. While llama.cpp builds: refinement conformance with extra
# seeds (the fused `_rf` entries now include 3 bits).
O=$OUT; t0=$(date +%s); mkdir -p /tmp/c $O/c
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/c/sfx; chmod +x /tmp/c/sfx; S=/tmp/c/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
(QUANTS="q2_k q4_k_m q4_0" DEADLINE=0 OUT=$O/c/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
for seed in 11 12; do
  timeout 100 $S test-backend --device cuda --op refined --op lead --op add_selected_columns --op select_channels --seed $seed > $O/c/refine_s$seed.md 2>&1
  echo "[$(el)s] refine ops seed $seed rc=$?: $(grep 'cases on cuda' $O/c/refine_s$seed.md)"
  grep -E '^\| [a-z_]+ \|' $O/c/refine_s$seed.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head
done
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=600 OUT=$O/c/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/c/peer/llamacpp_bench.md
for f in rtn2 rtn3 awq3 rtn4 qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
  [ $(el) -gt 560 ] && { echo "skip $f: past 560 s"; continue; }
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench --synthetic llama-3.1-8b --device cuda --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 > $O/c/bench_${f/:/_}.md 2>&1
  echo "[$(el)s] $f: $(grep -E '^\| llama' $O/c/bench_${f/:/_}.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
rm -f $O/c/peer/*.gguf
tar czf $O/c.tgz -C $O c && rm -rf $O/c
echo "total $(el) s"
