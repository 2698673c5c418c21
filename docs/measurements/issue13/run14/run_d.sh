#!/bin/bash
# Call D: issue 14's table for the rtn3 base now on the 3-bit tiles (its refinement applied by
# the `_rf` b3 entries), beside rtn2 as the control of session 48's table: refined at k = 4, 8,
# 16, 32, s = 0, 0.5 and 1, one process per base and s, × its own base row.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/d $O/d
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/d/sfx; chmod +x /tmp/d/sfx; S=/tmp/d/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for q in rtn3 rtn2; do for s in 0 0.5 1; do
  timeout 90 $S bench --synthetic llama-3.1-8b --device cuda --quant $q --fit --k 4,8,16,32 --s $s -p 0 -n 128 -r 2 > $O/d/refined_${q}_s$s.md 2>&1; rc=$?
  echo "[$(el)s] $q s=$s rc=$rc"; grep -E '^\| f16 \| tg128' $O/d/refined_${q}_s$s.md
done; done
SFX_PROFILE_KERNELS=1 timeout 90 $S bench --synthetic llama-3.1-8b --device cuda --quant rtn3 --fit --k 16 --s 0.5 -p 0 -n 32 -r 1 --graphs off > $O/d/profile_rtn3_k16_s05.md 2>&1
echo "[$(el)s] profile rc=$?"; grep -E "^\| [a-z_0-9]+ \|" $O/d/profile_rtn3_k16_s05.md | head -24
tar czf $O/d.tgz -C $O d && rm -rf $O/d
echo "total $(el) s"
