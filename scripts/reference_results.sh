#!/usr/bin/env bash
# Reproduces the float-reference numbers in docs/results.md: PPL on wiki:8 and
# austen-long:2048 for the GGUF (F32, dequantized in memory) and for its BF16 Hugging Face
# import, KL of the BF16 import against the F32 model, and decode/prefill speed.
# Usage: scripts/reference_results.sh [OUT_DIR]   (default: results/)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results}"
mkdir -p "$OUT"
bash scripts/fetch_assets.sh >/dev/null
cargo build --release -q
GGUF="${SFX_ASSETS:-assets}/SmolLM2-135M-Instruct.Q4_1.gguf"
HF="$OUT/smollm2-bf16"
RUN=./target/release/sfx-run

./target/release/sfx-convert import-gguf "$GGUF" -o "$HF" --json >"$OUT/import.json"
for spec in wiki:8 austen-long:2048; do
  tag=${spec/:/_}
  $RUN "$GGUF" --ppl "$spec" --json >"$OUT/gguf_f32_$tag.json"
  $RUN "$HF" --ppl "$spec" --kl-ref "$GGUF" --json >"$OUT/hf_bf16_$tag.json"
done
$RUN "$HF" -p "The history of the printing press" -n 128 --temp 0 --ignore-eos --json >"$OUT/generate_bf16.json"
$RUN "$GGUF" -p "The history of the printing press" -n 128 --temp 0 --ignore-eos --json >"$OUT/generate_f32.json"
echo "results in $OUT/"
