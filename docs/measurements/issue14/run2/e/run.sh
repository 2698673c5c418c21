#!/bin/bash
# Issue 14, second slice, call E: the review commit (958df50). The whole CUDA conformance suite,
# then the k ladder at s = 0 and 1 (rtn2, qtip2 HYB) beside call D's.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/b; xz -dc .gpu/final.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
timeout 400 $B test-backend --device cuda > $O/test_backend_cuda.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_cuda.md)"; grep -E "FAIL" $O/test_backend_cuda.md | head -5
for q in rtn2 qtip2; do for s in 0 1; do
  timeout 150 $B bench $M --quant $q --fit --k 4,16,32 --s $s -p 0 -n 128 -r 3 > $O/b.md 2>/dev/null
  grep -E "^\| f16 \| tg128 \| k" $O/b.md | sed "s/^/$q /"; grep -E "synthetic.* \| - \| tg128" $O/b.md | awk -F'|' '{print "base", $10}'; cat $O/b.md >> $O/bench_all.md
done; done
rm -f $O/b.md
echo "total $(( $(date +%s) - t0 )) s"
