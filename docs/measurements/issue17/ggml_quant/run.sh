#!/usr/bin/env bash
# Our own llama.cpp block rounding (`sfx-convert --quant q2_k … q6_k`, one type for every
# projection, llama.cpp's fallback for 576-wide rows) on SmolLM2, with refinement fitted at
# k = 8, 16, 32 in one ladder; wiki:4 KL to the float model of the base (k = 0) and each rung,
# beside llama.cpp's own files of the same types (`llama-quantize --pure`, run directly).
#   LQ=<llama.cpp build>/bin bash run.sh OUT
set -uo pipefail
G=${SFX_ASSETS:-assets}/SmolLM2-135M-Instruct.Q4_1.gguf
B=${B:-target/release}
R=${1:-/tmp/ggml_quant}; mkdir -p "$R"
for q in q2_k q3_k q4_k q6_k; do
  /usr/bin/time -f "convert $q %e s %M KB" $B/sfx-convert --quant $q "$G" --fit \
    --k-ladder 8,16,32 --k 16 -o "$R/smol.$q.fit.sfx" > "$R/convert_$q.log" 2>&1
  tail -1 "$R/convert_$q.log"
  for k in 0 8 16 32; do
    $B/sfx-run "$R/smol.$q.fit.sfx" --k $k --ppl wiki:4 --kl-ref "$G" --json \
      > "$R/eval_${q}_k$k.json"
  done
  if [ -n "${LQ:-}" ]; then
    Q=$(echo $q | tr a-z A-Z)
    case $Q in Q3_K) F=Q3_K_M ;; Q4_K) F=Q4_K_M ;; *) F=$Q ;; esac
    LD_LIBRARY_PATH=$LQ $LQ/llama-quantize --pure --allow-requantize "$G" "$R/smol.$q.pure.gguf" \
      $F 2 > "$R/quantize_$q.log" 2>&1
    $B/sfx-run "$R/smol.$q.pure.gguf" --ppl wiki:4 --kl-ref "$G" --json > "$R/eval_${q}_pure_gguf.json"
  fi
done
# The importance-weighted rounding (--imatrix: each input column's E[x²] over the calibration
# text as llama.cpp's importance), where it matters most: q2_k.
/usr/bin/time -f "convert q2_k --imatrix %e s %M KB" $B/sfx-convert --quant q2_k --imatrix "$G" \
  --fit --k-ladder 8,16,32 --k 16 -o "$R/smol.q2_k-imatrix.fit.sfx" > "$R/convert_q2_k-imatrix.log" 2>&1
tail -1 "$R/convert_q2_k-imatrix.log"
for k in 0 8 16 32; do
  $B/sfx-run "$R/smol.q2_k-imatrix.fit.sfx" --k $k --ppl wiki:4 --kl-ref "$G" --json \
    > "$R/eval_q2_k-imatrix_k$k.json"
done
