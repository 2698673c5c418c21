#!/bin/bash
# Call B2: tile plans for 3 bits (tg128 under each forced plan, default first and last). Carries
# the second part of SmolLM2 rtn3.sfx.
O=$OUT; t0=$(date +%s); mkdir -p $O/b2; S=/tmp/b/sfx; cp .gpu2/rtn3.p2 /tmp/b/
el() { echo $(( $(date +%s) - t0 )); }
[ -x $S ] || { echo "no sfx from call B1 (a fresh machine)"; exit 3; }
for plan in default 1,3 1,4 2,3 2,4 4,3 1,3,2,16 1,4,2 default; do
  env $([ $plan = default ] || echo SFX_GT_PLAN=$plan) timeout 60 $S bench --synthetic llama-3.1-8b --device cuda --quant rtn3 -p 0 -n 128 -r 3 > $O/b2/plan_$plan.md 2>&1
  echo "[$(el)s] $plan: $(grep -E '^\| llama' $O/b2/plan_$plan.md | awk -F'|' '{print $9 $10 $11}' | tr '\n' ' ')"
done
tar czf $O/b2.tgz -C $O b2 && rm -rf $O/b2
echo "total $(el) s"
