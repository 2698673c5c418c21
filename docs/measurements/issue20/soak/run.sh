#!/bin/bash
# Issue 20 item 3, the CPU soak: 20,000 tokens in one sfx-run process per configuration, as
# generations of 2,000 tokens (SmolLM2's context is 8,192; each generation starts from the
# prompt in a fresh cache), every KV base, the weight refinement on the ssd tier (8 MiB RAM
# cache) and, for the KVarN bases, their refinement bits on the ssd tier (256 KiB cache).
# Usage: run.sh SFX_RUN MODEL.sfx OUTDIR [TOKENS]
set -u
S=$1; M=$2; O=$3; N=${4:-20000}
mkdir -p "$O"
common=(-p "The history of the city begins" -n 2000 --soak "$N" --soak-every 250 --device cpu
        --refine-tier ssd --weight-cache 8MiB --json)
for kv in f16 2/2 3/2 3/3 2/1; do
  tag=${kv//\//_}
  if [ "$kv" = f16 ]; then extra=(--kv f16); else extra=(--kv "$kv" --kv-tier ssd --kv-cache 256KiB); fi
  /usr/bin/time -v "$S" "$M" "${common[@]}" "${extra[@]}" --soak-log "$O/soak_$tag.csv" \
    > "$O/soak_$tag.json" 2> "$O/soak_$tag.log"
  echo "$kv rc=$? $(grep -E 'Elapsed|Maximum resident' "$O/soak_$tag.log" | tr -s ' ' | tr '\n' ' ')"
done
