#!/bin/bash
# The review build (one item_at helper): trellis conformance and qtip2 tg128/pp512 beside the tok build.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in tok fin; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/fin/sfx
timeout 100 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
grep 'cases on cuda' $O/test_backend_trellis.md; grep FAIL $O/test_backend_trellis.md | head -5
for b in fin tok fin tok; do echo "$b $(timeout 60 /tmp/$b/sfx bench $M --quant qtip2 -p 512 -n 128 -r 3 2>&1 | grep -E 'pp512|tg128' | awk -F'|' '{print $8, $9}' | tr '\n' ' ')"; done | tee $O/ab_review.md
echo "total $(( $(date +%s) - t0 )) s"
