#!/bin/bash
# Issue 13, 3-bit tile layout, call A: conformance of the new b3 tile kernels (group ops with a
# fixed seed, every forced plan, then the whole suite) and tg128/pp512 of the 8B shape for
# rtn3 and awq3 on the tile kernels beside the same binary's file-layout kernels
# (SFX_GROUP_TILES=0) and rtn2/rtn4 on tiles.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/a $O/a
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/a/sfx; chmod +x /tmp/a/sfx; S=/tmp/a/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
run_tb() { # name, env..., args
  local n=$1; shift
  env "$@" > $O/a/$n.md 2>&1; local rc=$?
  echo "[$(el)s] $n rc=$rc: $(grep 'cases on cuda' $O/a/$n.md)"
  grep -E '^\| [a-z_]+ \|' $O/a/$n.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head -20
}
run_tb group timeout 90 $S test-backend --device cuda --op group --op embedding --seed 1
for plan in 1,3 1,4 2,3 2,4 4,4 1,3,2,16 1,4,4; do
  run_tb plan_${plan//,/_} SFX_GT_PLAN=$plan timeout 60 $S test-backend --device cuda --op group_ --seed 2
done
bench() { # name, env..., args
  local n=$1; shift
  env "$@" > $O/a/bench_$n.md 2>&1
  echo "[$(el)s] $n: $(grep -E '^\| llama' $O/a/bench_$n.md | awk -F'|' '{print $9 $10 $11}' | tr '\n' ' ')"
}
A="--synthetic llama-3.1-8b --device cuda -p 512 -n 128 -r 3"
bench rtn3 timeout 60 $S bench $A --quant rtn3
bench rtn3_rows SFX_GROUP_TILES=0 timeout 60 $S bench $A --quant rtn3
bench awq3 timeout 60 $S bench $A --quant awq3
bench rtn2 timeout 60 $S bench $A --quant rtn2
bench rtn4 timeout 60 $S bench $A --quant rtn4
bench rtn3_again timeout 60 $S bench $A --quant rtn3
bench rtn3_q6 timeout 60 $S bench $A --quant rtn3 --head q6
run_tb all timeout $(( 560 - $(el) )) $S test-backend --device cuda --seed 3
tar czf $O/a.tgz -C $O a && rm -rf $O/a
echo "total $(el) s"
