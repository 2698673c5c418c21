#!/bin/bash
B=$PWD/.gpu/bin; O=$OUT
cp $B/sfx /tmp/sfx; S=/tmp/sfx
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
$S test-backend --device cuda > $O/test_backend_cuda.md 2>&1; grep "cases on cuda" $O/test_backend_cuda.md
grep -E '^\| ' $O/test_backend_cuda.md | grep -v -E '\| ok \||^\| op|^\| ---' | head -20
for op in trellis_linear trellis_projections trellis_swiglu model_decode; do
  SFX_TR_PROLOGUE=0 $S test-backend --device cuda --op $op > $O/tb_noprologue_$op.md 2>&1
  echo "noprologue $op: $(grep 'cases on cuda' $O/tb_noprologue_$op.md)"
done
echo "conformance $(( $(date +%s) - t0 )) s"
{
for cfg in "SFX_TR_PROLOGUE=1" "SFX_TR_PROLOGUE=0"; do
  echo "## $cfg qtip2 hyb"; env $cfg $S bench $M --quant qtip2 -p 0 -n 128 -r 3 2>&1 | grep -E 'synthetic|rror'
done
echo "## qtip2 1mad"; $S bench $M --quant qtip2 --trellis-code 1mad -p 0 -n 128 -r 3 2>&1 | grep -E 'synthetic|rror'
for q in rtn2 rtn4 rtn3; do for tpr in default 256 32 16; do
  echo "## $q SFX_GROUP_TPR=$tpr"; env $([ $tpr = default ] || echo SFX_GROUP_TPR=$tpr) $S bench $M --quant $q -p 0 -n 128 -r 3 2>&1 | grep -E 'synthetic|rror'
done; done
} 2>&1 | tee $O/bench.md
echo "bench $(( $(date +%s) - t0 )) s"
SFX_PROFILE_KERNELS=1 timeout 120 $S bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > $O/profile_qtip2.md 2> $O/profile_qtip2.err
grep -E '^\| ' $O/profile_qtip2.err | head -16
SFX_PROFILE_KERNELS=1 timeout 120 $S bench $M --quant rtn2 -p 0 -n 16 -r 1 --graphs off > $O/profile_rtn2.md 2> $O/profile_rtn2.err
grep -E '^\| ' $O/profile_rtn2.err | head -8
echo "total $(( $(date +%s) - t0 )) s"
