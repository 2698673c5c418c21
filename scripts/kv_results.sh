#!/usr/bin/env bash
# Reproduces the KV-refinement numbers in docs/results.md (issue 5): SmolLM2-135M on
# austen-long:L (default 8192, the model's context), every KVarN base with and without
# refinement, fraction and group sweeps, the SSD tier, and KV + weight refinement together.
# Usage: scripts/kv_results.sh [OUT_DIR] [L]   (default: results/kv 8192). ~60 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results/kv}"
L="${2:-8192}"
mkdir -p "$OUT"
bash scripts/fetch_assets.sh >/dev/null
cargo build --release -q
GGUF="${SFX_ASSETS:-assets}/SmolLM2-135M-Instruct.Q4_1.gguf"
RUN=./target/release/sfx-run
EVAL="--ppl austen-long:$L --json"

# 1. Every base alone and refined (+4/+4, +0/+1 for 2/1; 2-token groups) at three fractions.
$RUN "$GGUF" $EVAL --kv f16,2/2,3/2,3/3,2/1 --kv-fraction 1/256,1/128,1/64 >"$OUT/kv_bases.json"
# 2. Four-token groups, RAM vs SSD spill behind a 2 MiB RAM cache (skip misses), 2/2 and 3/2.
$RUN "$GGUF" $EVAL --kv 2/2,3/2 --no-base --kv-group 4 --kv-tier ram,ssd --kv-cache 2MiB \
  >"$OUT/kv_groups_tiers.json"
# 3. SSD RAM-cache size with skipped misses, and 2/1 (+0/+1) at higher fractions.
$RUN "$GGUF" $EVAL --kv 2/2 --no-base --kv-group 4 --kv-tier ssd --kv-cache 1MiB,4MiB,16MiB \
  >"$OUT/kv_ssd_cache.json"
$RUN "$GGUF" $EVAL --kv 2/1 --no-base --kv-fraction 1/32,1/16 >"$OUT/kv_21_fraction.json"
# 4. KV and weight refinement together: rtn3 --fit weights (ram tier), KL to the float model
#    with FP16 KV.
HF="$OUT/smol-bf16"
SFX="$OUT/rtn3-fit.sfx"
[ -d "$HF" ] || ./target/release/sfx-convert import-gguf "$GGUF" -o "$HF" >/dev/null
[ -f "$SFX" ] || ./target/release/sfx-convert --quant rtn3 --head bf16 --fit "$HF" -o "$SFX" --json >"$OUT/convert_rtn3.json"
$RUN "$SFX" $EVAL --kv f16,2/2 --kl-ref "$GGUF" >"$OUT/kv_with_weights.json"
$RUN "$SFX" $EVAL --kv f16,2/2 --kl-ref "$GGUF" --no-refine >"$OUT/kv_with_weights_base.json"
echo "results in $OUT/"
