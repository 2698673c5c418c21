#!/bin/bash
# Call A. (1) Short-context decode attention (new: first tile fetched before the queries are
# staged, new rows patched in shared memory, one chunk writes its output directly, four partial
# sums per score) vs HEAD (old); (2) group tile matvec plans with tile sets taken in sequence
# and an 8-slot ring (new2 = new + those kernels, SFX_GT_PLAN); (3) the 16-row batched Paley mix
# (new3 = new2 + it). llama.cpp builds in the background for call B (run15.sh).
O=$OUT; R=/tmp/run14; mkdir -p $R /tmp/old /tmp/new /tmp/new2 /tmp/new3
for b in old new new2 new3; do xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/new2 PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
S=/tmp/new2/sfx; M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
for op in attention rope_attention model_decode; do
  timeout 100 $S test-backend --device cuda --op $op > /tmp/tb_$op.md 2>&1
  echo "new2 $op: $(grep 'cases on cuda' /tmp/tb_$op.md)"; grep -E "\| FAIL" /tmp/tb_$op.md | head -5
done
for plan in 1,3,4 1,8,2; do for op in group_linear group_projections group_swiglu; do
  SFX_GT_PLAN=$plan timeout 100 $S test-backend --device cuda --op $op > /tmp/tbg_${plan}_$op.md 2>&1
  echo "new2 plan $plan $op: $(grep 'cases on cuda' /tmp/tbg_${plan}_$op.md)"; grep -E "\| FAIL" /tmp/tbg_${plan}_$op.md | head -3
done; done | tee $R/group_conformance.txt
for op in trellis_linear trellis_projections trellis_swiglu model_decode; do
  timeout 60 /tmp/new3/sfx test-backend --device cuda --op $op > /tmp/tb3_$op.md 2>&1
  echo "new3 $op: $(grep 'cases on cuda' /tmp/tb3_$op.md)"; grep -E "\| FAIL" /tmp/tb3_$op.md | head -3
done | tee $R/b16_conformance.txt
cat /tmp/tb_*.md /tmp/tbg_*.md /tmp/tb3_*.md > $O/test_backend.md
echo "conformance $(( $(date +%s) - t0 )) s"
for b in old new; do
  echo "$b attn_decode µs: $(timeout 60 ncu --clock-control none --cache-control none --kernel-name regex:attn_decode --launch-skip 100 --launch-count 6 \
    --metrics gpu__time_duration.sum /tmp/$b/sfx bench $M --quant rtn4 -p 0 -n 8 -r 1 --graphs off 2>&1 | grep -E "duration" | awk '{print $NF}' | tr '\n' ' ')"
done | tee $O/ncu_attention.txt
tg() { timeout 60 $1/sfx bench $M --quant $2 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
echo "rtn4 tg128 new $(tg /tmp/new rtn4) $(tg /tmp/new rtn4) old $(tg /tmp/old rtn4) $(tg /tmp/old rtn4)" | tee $O/ab_attention.md
for q in rtn2 qtip2; do echo "$q tg128 new $(tg /tmp/new $q) old $(tg /tmp/old $q) new2 $(tg /tmp/new2 $q)"; done | tee -a $O/ab_attention.md
echo "qtip2 tg128 new3 $(tg /tmp/new3 qtip2) $(tg /tmp/new3 qtip2) new2 $(tg /tmp/new2 qtip2) $(tg /tmp/new2 qtip2)" | tee $O/ab_b16.md $R/ab_b16.md
echo "attention ab $(( $(date +%s) - t0 )) s"
for plan in 1,3,1 1,3,2 1,3,4 1,8,1 1,8,2; do
  echo "plan $plan rtn4 $(SFX_GT_PLAN=$plan tg /tmp/new2 rtn4) rtn2 $(SFX_GT_PLAN=$plan tg /tmp/new2 rtn2)"
done | tee $O/plans.md $R/plans.md
for plan in 1,3,1 1,3,4 1,8,1; do
  SFX_GT_PLAN=$plan timeout 60 ncu --clock-control none --cache-control none --kernel-name regex:gt_ --launch-skip 40 --launch-count 8 \
    --metrics gpu__time_duration.sum $S bench $M --quant rtn4 -p 0 -n 4 -r 1 --graphs off 2>&1 \
    | grep -E "^  gt_|duration" | paste - - | awk -v p=$plan '{print p, $1, $(NF)}'
done | tee $O/ncu_plans.txt
cat /tmp/peerprep.log 2>/dev/null | tail -2
echo "total $(( $(date +%s) - t0 )) s"
