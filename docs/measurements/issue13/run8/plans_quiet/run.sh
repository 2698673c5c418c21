#!/bin/bash
# Run on the same warm machine right after chosen/run.sh (new2 in /tmp/new2): tile plans on a
# quiet machine (tg128), then ncu durations of the tile matvecs of one layer per plan.
S=/tmp/new2/sfx; M="--synthetic llama-3.1-8b --device cuda"
tg() { timeout 60 $S bench $M --quant $1 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for plan in 1,3,1 1,3,2 1,4,1 1,4,2 1,3,1; do echo "plan $plan rtn4 $(SFX_GT_PLAN=$plan tg rtn4) rtn2 $(SFX_GT_PLAN=$plan tg rtn2)"; done | tee $OUT/plans_quiet.md
for plan in 1,3,1 1,3,2 1,8,1; do for q in rtn4 rtn2; do
  SFX_GT_PLAN=$plan timeout 60 ncu --clock-control none --cache-control none --kernel-name regex:'gt_matvec|gt_swiglu' --launch-skip 200 --launch-count 8 \
    --metrics gpu__time_duration.sum $S bench $M --quant $q -p 0 -n 4 -r 1 --graphs off 2>&1 | grep -E "^  gt_|duration" | paste - - | awk -v p=$plan -v q=$q '{print p, q, $1, $(NF)}'
done; done | tee $OUT/ncu_plans.txt
