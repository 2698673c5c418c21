#!/bin/bash
# Diagnostics: where an rtn4 decode step goes (event profile + ncu of one step), the attention
# kernel in detail, and the untested 16-row batched Paley mix (conformance + tg128 A/B).
B=$PWD/.gpu/bin; O=$OUT
mkdir -p /tmp/new /tmp/b16; cp $B/sfx /tmp/new/sfx; cp $B/sfx_batch16 /tmp/b16/sfx; S=/tmp/new/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv
SFX_PROFILE_KERNELS=1 timeout 100 $S bench $M --quant rtn4 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_rtn4.err
grep -E '^\| ' $O/profile_rtn4.err | head -16
timeout 150 ncu --clock-control none --cache-control none --launch-skip 600 --launch-count 230 --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__inst_executed.sum,launch__grid_size,launch__block_size \
  $S bench $M --quant rtn4 -p 0 -n 8 -r 1 --graphs off > /tmp/ncu_step_rtn4.csv 2>&1
gzip -c /tmp/ncu_step_rtn4.csv > $O/ncu_step_rtn4.csv.gz
echo "ncu step $(( $(date +%s) - t0 )) s"
timeout 100 ncu --clock-control none --cache-control none --set full --kernel-name regex:attn_decode --launch-skip 100 --launch-count 1 \
  $S bench $M --quant rtn4 -p 0 -n 8 -r 1 --graphs off > $O/ncu_attention_full.txt 2>&1
echo "ncu attn $(( $(date +%s) - t0 )) s"
for op in trellis_linear trellis_projections trellis_swiglu model_decode; do
  timeout 60 /tmp/b16/sfx test-backend --device cuda --op $op > /tmp/tb_$op.md 2>&1
  echo "b16 $op: $(grep 'cases on cuda' /tmp/tb_$op.md)"; grep -E "\| FAIL" /tmp/tb_$op.md | head -3
done
tg() { timeout 60 $1/sfx bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}'; }
for q in qtip2 rtn4; do
  echo "$q tg128 b16 $(tg /tmp/b16 $q) $(tg /tmp/b16 $q) new $(tg /tmp/new $q) $(tg /tmp/new $q)"
done | tee $O/ab.md
echo "rtn2 $(tg /tmp/new rtn2)"
echo "total $(( $(date +%s) - t0 )) s"
