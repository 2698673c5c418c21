#!/bin/bash
# Issue 13, twelfth slice, call E: the transforms' row-mix coefficients staged in shared memory
# before the PDL wait and each thread's row-mix loads issued together (mix), against the PDL
# build of call C (pdl): conformance, tg128 A/B in one call, per-kernel times (graphs off).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in pdl mix; do mkdir -p /tmp/$b; xz -dc .gpu/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done
timeout 150 /tmp/mix/sfx test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep FAIL $O/test_backend_trellis.md | head -5
tg() { timeout 60 $1 bench $M --quant $2 -p 0 -n 128 -r 3 "${@:3}" 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}' | tr '\n' ' '; }
for round in 1 2; do
  for f in qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
    code=(--trellis-code "${f##*:}"); q=${f%%:*}
    echo "$f r$round pdl $(tg /tmp/pdl/sfx $q "${code[@]}") mix $(tg /tmp/mix/sfx $q "${code[@]}")"
  done
done | tee $O/ab_mix.md
for b in pdl mix; do
  SFX_PROFILE_KERNELS=1 timeout 60 /tmp/$b/sfx bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2_$b.err
  grep -E "tr_" $O/profile_qtip2_$b.err | sed "s/^/$b /"
done
echo "total $(( $(date +%s) - t0 )) s"
