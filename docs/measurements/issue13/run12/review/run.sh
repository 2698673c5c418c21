#!/bin/bash
# Issue 13, twelfth slice, call G: the review build (one launch path builds the kernel
# arguments for plain and PDL launches; behaviour unchanged): the whole conformance suite, then
# tg128 of qtip2 HYB and rtn2 beside call F's build (final).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in final review; do mkdir -p /tmp/$b; xz -dc .gpu/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done
timeout 300 /tmp/review/sfx test-backend --device cuda > $O/test_backend_cuda.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_cuda.md) in $(( $(date +%s) - t0 )) s"; grep FAIL $O/test_backend_cuda.md | head -5
tg() { timeout 60 $1 bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}' | tr '\n' ' '; }
for q in qtip2 rtn2; do echo "$q final $(tg /tmp/final/sfx $q) review $(tg /tmp/review/sfx $q)"; done | tee $O/ab_review.md
echo "total $(( $(date +%s) - t0 )) s"
