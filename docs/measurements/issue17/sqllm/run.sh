#!/usr/bin/env bash
# SqueezeLLM look-up-table bases against group bases on SmolLM2 (issue 17, item 1), CPU.
# Every file: --fit, k = 16, Brown 16 × 512 calibration, q8 head; SqueezeLLM's Fisher diagonal
# from the first 8 calibration sequences; AWQ on a 10 × 10 grid (2 cores). Each file is
# evaluated on wiki:8 against the float GGUF; the k = 16 run reports the base (k = 0) beside
# the refined model.
# BIN=target/release (or any folder with sfx-convert and sfx-run), OUT=results folder.
set -euo pipefail
BIN=${BIN:-target/release}
OUT=${OUT:-docs/measurements/issue17/sqllm/out}
GGUF=${GGUF:-assets/SmolLM2-135M-Instruct.Q4_1.gguf}
QUANTS=${QUANTS:-"sqllm4 rtn4 sqllm3 rtn3 awq4 awq3 sqllm2"}
mkdir -p "$OUT"
for q in $QUANTS; do
  f="$OUT/$q.sfx"
  if [ ! -f "$f" ]; then
    /usr/bin/time -v "$BIN/sfx-convert" --quant "$q" --fit "$GGUF" -o "$f" \
      --calib-seqs 16 --calib-len 512 --yaqa-seqs 8 --awq-grid 10,10 --json \
      > "$OUT/$q.convert.json" 2> "$OUT/$q.convert.log"
  fi
  "$BIN/sfx-run" "$f" --k 16 --ppl wiki:8 --kl-ref "$GGUF" --json > "$OUT/$q.k16.json" 2> "$OUT/$q.k16.log"
  rm -f "$f"
done
