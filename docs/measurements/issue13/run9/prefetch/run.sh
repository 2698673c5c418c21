#!/bin/bash
# L2 prefetch of the tile matvecs' weights (SFX_L2_PREFETCH) A/B, after the full conformance
# suite on the same build (attention's warp merge is now one helper).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/pf; xz -dc .gpu/xz/pf.xz > /tmp/pf/sfx; chmod +x /tmp/pf/sfx; S=/tmp/pf/sfx
timeout 200 $S test-backend --device cuda > $O/test_backend_cuda.md 2>&1
grep "cases on cuda" $O/test_backend_cuda.md; grep -E "\| FAIL" $O/test_backend_cuda.md | head -5
echo "conformance $(( $(date +%s) - t0 )) s"
tg() { timeout 40 env $1 $S bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for q in rtn4 rtn2 rtn4 rtn2 qtip2; do echo "$q tg128 prefetch $(tg SFX_L2_PREFETCH=1 $q) off $(tg SFX_L2_PREFETCH=0 $q) prefetch $(tg SFX_L2_PREFETCH=1 $q)"; done | tee $O/ab_prefetch.md
echo "total $(( $(date +%s) - t0 )) s"
