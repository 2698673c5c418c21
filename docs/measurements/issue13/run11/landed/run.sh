#!/bin/bash
# Issue 15 first op + issue 13 landed-code check, one call: the KVarN decode attention
# conformance (every base, GQA 1-7, head 64/128) and the float attention ops beside it; the
# trellis conformance on the landed trellis code; tg128 of the landed code (kv1) against the
# measured c32 build for the HYB codes.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in kv1 c32; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/kv1/sfx
timeout 120 $S test-backend --device cuda --op kvarn_attention --op attention --op rope_attention > $O/test_backend_kvarn.md 2>&1
echo "kvarn: $(grep 'cases on cuda' $O/test_backend_kvarn.md)"; grep -E "kvarn|FAIL" $O/test_backend_kvarn.md | grep -v " ok" | head -8; grep kvarn_attention $O/test_backend_kvarn.md | head -3
timeout 120 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "trellis: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep FAIL $O/test_backend_trellis.md | head -3
tg() { timeout 60 $1 bench $M --quant $2 "${@:3}" -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for f in qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
  code=(--trellis-code "${f##*:}"); q=${f%%:*}
  for round in 1 2; do echo "$f r$round landed $(tg $S $q "${code[@]}") c32 $(tg /tmp/c32/sfx $q "${code[@]}")"; done
done | tee $O/ab_landed.md
echo "total $(( $(date +%s) - t0 )) s"
