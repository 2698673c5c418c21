#!/bin/bash
# Issue 13, twelfth slice, call C: the PDL-by-default build (trellis chain only): trellis and
# model-decode conformance, tg128 against SFX_PDL=0, a refined qtip2 run under PDL; then ncu's
# per-source-line counters of one o and one q/k/v matvec launch (-lineinfo build), to place
# the launches' fixed cost.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/p; xz -dc .gpu/pdl.xz > /tmp/p/sfx; chmod +x /tmp/p/sfx; S=/tmp/p/sfx
timeout 150 $S test-backend --device cuda --op trellis --op model_decode > $O/test_backend_trellis.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep FAIL $O/test_backend_trellis.md | head -5
tg() { timeout 60 env $1 $S bench $M --quant $2 -p 0 -n 128 -r 3 "${@:3}" 2>&1 | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}' | tr '\n' ' '; }
for round in 1 2; do
  echo "qtip2 r$round default $(tg X=1 qtip2) pdl0 $(tg SFX_PDL=0 qtip2) | rtn2 default $(tg X=1 rtn2)"
done | tee $O/pdl_default.md
timeout 120 $S bench $M --quant qtip2 -p 0 -n 64 -r 2 --fit --k 16 > $O/qtip2_fit_k16.md 2>&1; tail -4 $O/qtip2_fit_k16.md
for L in 41:o 40:qkv; do
  timeout 100 ncu --clock-control none --cache-control none --set full --import-source yes --kernel-name regex:tr_matvec \
    --launch-skip ${L%%:*} --launch-count 1 -o /tmp/rep_${L##*:} $S bench $M --quant qtip2 -p 0 -n 2 -r 1 --graphs off > /dev/null 2>&1
  ncu -i /tmp/rep_${L##*:}.ncu-rep --page source --csv --print-source cuda > $O/src_${L##*:}_cuda.csv 2>/dev/null
  ncu -i /tmp/rep_${L##*:}.ncu-rep --page source --csv --print-source sass > /tmp/sass.csv 2>/dev/null; gzip -c /tmp/sass.csv > $O/src_${L##*:}_sass.csv.gz
  ls -la $O/src_${L##*:}_cuda.csv
done
echo "total $(( $(date +%s) - t0 )) s"
