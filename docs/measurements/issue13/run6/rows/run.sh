#!/bin/bash
B=$PWD/.gpu/bin; O=$OUT
cp $B/sfx /tmp/sfx; cp $B/sfx_prev /tmp/sfx_prev; S=/tmp/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
for op in trellis_linear trellis_projections trellis_swiglu model_decode; do
  $S test-backend --device cuda --op $op > $O/tb_$op.md 2>&1
  echo "$op: $(grep 'cases on cuda' $O/tb_$op.md)"
  grep -E '^\| ' $O/tb_$op.md | grep -v -E '\| ok \||^\| op|^\| ---' | head -8
done
echo "conformance $(( $(date +%s) - t0 )) s"
{
for r in 1 2; do for b in sfx sfx_prev; do
  echo "## $b qtip2 hyb"; /tmp/$b bench $M --quant qtip2 -p 0 -n 128 -r 3 2>&1 | grep -E 'synthetic|rror' | grep tg
done; done
echo "## sfx qtip2 1mad"; $S bench $M --quant qtip2 --trellis-code 1mad -p 0 -n 128 -r 3 2>&1 | grep -E 'tg|rror'
echo "## sfx qtip3 hyb pp"; $S bench $M --quant qtip3 -p 512 -n 128 -r 2 2>&1 | grep -E '(tg|pp)[0-9]|rror'
} 2>&1 | tee $O/bench.md
echo "bench $(( $(date +%s) - t0 )) s"
SFX_PROFILE_KERNELS=1 timeout 120 $S bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > $O/profile_qtip2.md 2> $O/profile_qtip2.err
grep -E '^\| ' $O/profile_qtip2.err | head -16
$S test-backend --device cuda > $O/test_backend_cuda.md 2>&1; grep "cases on cuda" $O/test_backend_cuda.md
echo "total $(( $(date +%s) - t0 )) s"
