#!/usr/bin/env bash
# llama.cpp's own Q2_K / Q3_K_M / Q4_K_M of SmolLM2 (llama-quantize from the peer kit's source,
# CPU build, no importance matrix) kept as resident bases; refinement fitted at k = 8, 16, 32
# in one ladder against the float model (the asset, dequantized); wiki:4 KL to the float model
# of the GGUF run directly, the container's base (k = 0) and each rung.
#   LQ=<llama.cpp build>/bin bash run.sh OUT
set -uo pipefail
G=${SFX_ASSETS:-assets}/SmolLM2-135M-Instruct.Q4_1.gguf
B=${B:-target/release}
R=${1:-/tmp/gguf_base}; mkdir -p "$R"
for q in Q2_K Q3_K_M Q4_K_M; do
  LD_LIBRARY_PATH=$LQ $LQ/llama-quantize --allow-requantize "$G" "$R/smol.$q.gguf" $q 2 \
    > "$R/quantize_$q.log" 2>&1
  /usr/bin/time -f "convert $q %e s %M KB" $B/sfx-convert --quant gguf "$R/smol.$q.gguf" \
    --float-source "$G" --fit --k-ladder 8,16,32 --k 16 -o "$R/smol.$q.fit.sfx" \
    > "$R/convert_$q.log" 2>&1
  tail -1 "$R/convert_$q.log"
  $B/sfx-run "$R/smol.$q.gguf" --ppl wiki:4 --kl-ref "$G" --json > "$R/eval_${q}_gguf.json"
  for k in 0 8 16 32; do
    $B/sfx-run "$R/smol.$q.fit.sfx" --k $k --ppl wiki:4 --kl-ref "$G" --json \
      > "$R/eval_${q}_k$k.json"
  done
done
