#!/bin/bash
# Issue 13, twelfth slice, call D: the output transform folded into the matvec's last block
# (q/k/v, o, down; SFX_TR_FOLD_FINISH=0 launches tr_finish as before): trellis and
# model-decode conformance, then tg128 with and without the fold, PDL on (the new default).
# The build: this slice's launch policy with fold.patch (measured and dropped, not in the tree).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/f; xz -dc .gpu/fold.xz > /tmp/f/sfx; chmod +x /tmp/f/sfx; S=/tmp/f/sfx
timeout 150 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep FAIL $O/test_backend_trellis.md | head -5
tg() { timeout 60 env $1 $S bench $M --quant $2 -p 0 -n 128 -r 3 "${@:3}" 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}' | tr '\n' ' '; }
for round in 1 2; do
  for f in qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
    code=(--trellis-code "${f##*:}"); q=${f%%:*}
    echo "$f r$round fold $(tg X=1 $q "${code[@]}") nofold $(tg SFX_TR_FOLD_FINISH=0 $q "${code[@]}")"
  done
done | tee $O/ab_fold.md
echo "total $(( $(date +%s) - t0 )) s"
