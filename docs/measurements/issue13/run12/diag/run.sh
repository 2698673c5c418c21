#!/bin/bash
# Issue 13, twelfth slice, call A: where a qtip2 HYB token's time goes inside the step graph,
# by leaving stages out (a diagnostic build: 9b59224 with diag_skip.patch, whose
# SFX_DIAG_TR_SKIP drops the named trellis stages, so the tokens are wrong and only the times
# count), and whether programmatic dependent launch pays for the trellis chain (SFX_PDL=1).
# The ncu call (B) used the same build.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/d; xz -dc .gpu/diag.xz > /tmp/d/sfx; chmod +x /tmp/d/sfx; S=/tmp/d/sfx
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
tg() { timeout 60 env $1 $S bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}'; }
for round in 1 2; do
  for q in qtip2 rtn2; do echo "$q r$round base $(tg X=1 $q)"; done
  for skip in finish swiglu prepare finish+swiglu+prepare decode matvec decode+finish+swiglu+prepare matvec+finish+swiglu+prepare; do
    echo "qtip2 r$round skip=$skip $(tg SFX_DIAG_TR_SKIP=$skip qtip2)"
  done
  echo "qtip2 r$round pdl $(tg SFX_PDL=1 qtip2)"
  echo "qtip2 r$round pdl skip=decode $(tg "SFX_PDL=1 SFX_DIAG_TR_SKIP=decode" qtip2)"
done | tee $O/diag.md
SFX_PROFILE_KERNELS=1 timeout 60 $S bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2.err
SFX_PROFILE_KERNELS=1 SFX_DIAG_TR_SKIP=decode timeout 60 $S bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2_nodecode.err
head -12 $O/profile_qtip2.err; head -12 $O/profile_qtip2_nodecode.err
echo "total $(( $(date +%s) - t0 )) s"
