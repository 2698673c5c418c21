#!/usr/bin/env bash
# Block against full Hadamard rotations of the trellis bases on SmolLM2 (issue 13), CPU: the
# protocol of docs/measurements/issue17/sqllm/run.sh (--fit, k = 16, Brown 16 × 512
# calibration, q8 head, wiki:8 KL against the float GGUF; the k = 16 run reports the base
# beside the refined model), once per QUANT:ROTATION.
# BIN=target/release (or any folder with sfx-convert and sfx-run), OUT=results folder.
set -euo pipefail
BIN=${BIN:-target/release}
OUT=${OUT:-docs/measurements/issue13/rotation/out}
GGUF=${GGUF:-assets/SmolLM2-135M-Instruct.Q4_1.gguf}
RUNS=${RUNS:-"qtip2:b128 qtip2:full qtip4:b128"}
mkdir -p "$OUT"
for r in $RUNS; do
  q=${r%%:*}; rot=${r##*:}; name=$q-$rot
  f="$OUT/$name.sfx"
  if [ ! -f "$f" ]; then
    /usr/bin/time -v "$BIN/sfx-convert" --quant "$q" --rotation "$rot" --fit "$GGUF" -o "$f" \
      --calib-seqs 16 --calib-len 512 --json \
      > "$OUT/$name.convert.json" 2> "$OUT/$name.convert.log"
  fi
  "$BIN/sfx-run" "$f" --k 16 --ppl wiki:8 --kl-ref "$GGUF" --json > "$OUT/$name.k16.json" 2> "$OUT/$name.k16.log"
  rm -f "$f"
done
