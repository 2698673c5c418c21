#!/bin/bash
# Issue 14, third slice, call B: a decode row's refinement applied inside the projections'
# launches (group codes: the matvec's epilogue; trellis codes: the output transform's
# launch), and fetch lag's contributions added by the o/down launch where they land.
# Conformance of the ops this touches on the new build (and the refined decode steps again
# with the engine's fused path on); then A/B per row pair in back-to-back processes:
# SFX_FUSED_REFINE=0 (the engine's branches and adds, the default) vs =1 (fused launches),
# at s = 0 and at lead 1 (q/k/v, gate/up) with lag 0.5 (o, down); the unrefined base of the
# build before the slice (main) beside this build's.
# Binaries (carry [".gpu"]): .gpu/main.xz = `make build-gpu` of cad5c6a, .gpu/fused.xz = of
# this slice, each stripped and xz-compressed.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
left() { [ $(( $(date +%s) - t0 )) -lt $1 ]; }
mkdir -p /tmp/b; for n in main fused; do xz -dc .gpu/$n.xz > /tmp/b/$n; chmod +x /tmp/b/$n; done
timeout 240 /tmp/b/fused test-backend --device cuda --op refined --op model_decode --op group --op trellis \
  --op select_channels --op lead_columns --op add_selected > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | head -8
grep -E "refined" $O/test_backend.md | grep model_decode | cut -c1-150
SFX_FUSED_REFINE=1 timeout 120 /tmp/b/fused test-backend --device cuda --op model_decode > $O/test_backend_fused.md 2>&1
echo "fused engine rc=$?: $(grep 'cases on cuda' $O/test_backend_fused.md)"; grep -E "FAIL" $O/test_backend_fused.md | head -8
echo "t=$(( $(date +%s) - t0 ))"
for q in rtn2 qtip2; do for s in 0 1,0.5,1,0.5; do for v in 0 1; do
  left 500 || break 3
  SFX_FUSED_REFINE=$v timeout 90 /tmp/b/fused bench $M --quant $q --fit --k 4,16,32 --s $s -p 0 -n 128 -r 2 > $O/bench_${q}_s${s}_f$v.md 2>&1
  echo "$q s=$s fused=$v t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" $O/bench_${q}_s${s}_f$v.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" $O/bench_${q}_s${s}_f$v.md
done; done; done
for q in rtn2 qtip2; do for n in main fused; do
  left 570 || break 2
  timeout 40 /tmp/b/$n bench $M --quant $q -p 0 -n 128 -r 3 2>/dev/null | grep -E "tg128" | awk -F'|' -v n=$n -v q=$q '{print n, q, "base", $10}'
done; done
echo "total $(( $(date +%s) - t0 )) s"
