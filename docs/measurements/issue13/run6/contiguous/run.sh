#!/bin/bash
B=$PWD/.gpu/bin; O=$OUT
cp $B/sfx /tmp/sfx; cp $B/sfx_rows /tmp/sfx_rows; S=/tmp/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
for op in trellis_linear trellis_projections trellis_swiglu model_decode; do
  $S test-backend --device cuda --op $op > $O/tb_$op.md 2>&1
  echo "$op: $(grep 'cases on cuda' $O/tb_$op.md)"
  grep -E '^\| ' $O/tb_$op.md | grep -v -E '\| ok \||^\| op|^\| ---' | head -8
done
for op in group_linear group_projections group_swiglu; do
  SFX_GROUP_TPR=8 $S test-backend --device cuda --op $op > $O/tb_tpr8_$op.md 2>&1
  echo "tpr8 $op: $(grep 'cases on cuda' $O/tb_tpr8_$op.md)"
done
echo "conformance $(( $(date +%s) - t0 )) s"
tg() { local e=(); while [[ $1 == *=* ]]; do e+=("$1"); shift; done; local b=$1; shift
  env "${e[@]}" $b bench $M "$@" -p 0 -n 128 -r 3 2>&1 | grep -E 'tg128|rror' | grep -v graphs | awk -F'|' '{print $9}'; }
{
for r in 1 2; do
  echo "qtip2 hyb new: $(tg /tmp/sfx --quant qtip2)   rows-only: $(tg /tmp/sfx_rows --quant qtip2)"
done
echo "qtip2 hyb new SFX_TR_PROLOGUE=0: $(tg SFX_TR_PROLOGUE=0 /tmp/sfx --quant qtip2)"
echo "qtip2 hyb new SFX_TR_ROWS=2: $(tg SFX_TR_ROWS=2 /tmp/sfx --quant qtip2)"
echo "qtip2 1mad new: $(tg /tmp/sfx --quant qtip2 --trellis-code 1mad)"
for q in rtn3 rtn2 rtn4; do
  for k in default SFX_GROUP_WIDE=1 SFX_GROUP_WIDE=2 SFX_GROUP_WIDE=4 SFX_GROUP_TPR=8 SFX_GROUP_TPR=16; do
    echo "$q $k: $(tg $([ $k = default ] || echo $k) /tmp/sfx --quant $q)"
  done
done
} 2>&1 | tee $O/bench.md
echo "bench $(( $(date +%s) - t0 )) s"
SFX_PROFILE_KERNELS=1 timeout 120 $S bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > $O/profile_qtip2.md 2> $O/profile_qtip2.err
grep -E '^\| ' $O/profile_qtip2.err | head -8
echo "total $(( $(date +%s) - t0 )) s"
