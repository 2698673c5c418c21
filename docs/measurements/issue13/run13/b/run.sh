#!/bin/bash
# Issue 13, thirteenth slice, call B: where the persistent MLP's time goes — each block stamps
# the global timer at every stage's end and barrier's exit (SFX_TR_MLP_TIMES=1, graphs off).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"
mkdir -p /tmp/b; xz -dc .gpu/mlp.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
for q in qtip2:hyb qtip4:hyb; do
  SFX_TR_MLP_TIMES=1 timeout 60 $B bench $M --quant ${q%%:*} --trellis-code ${q##*:} -p 0 -n 4 -r 1 --graphs off > /dev/null 2> $O/times_${q%%:*}.err
  echo "$q"; grep "tr_mlp µs" $O/times_${q%%:*}.err | tail -4
done
