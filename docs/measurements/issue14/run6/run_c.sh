#!/bin/bash
# Issue 14 sixth slice, call C, the landed build (the gather scratch's tickets in a fixed
# region; coded refined decode cases decode-only): issue 14's table on the 8B shape (qtip2 and
# rtn2 bases, refined at k = 4, 8, 16, 32, s = 0, 0.5 and 1, one process per base and s, × its
# own base row), then the whole conformance suite.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/c $O/c
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/c/sfx; chmod +x /tmp/c/sfx; S=/tmp/c/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for q in qtip2 rtn2; do for s in 0 0.5 1; do
  timeout 90 $S bench --synthetic llama-3.1-8b --device cuda --quant $q --fit --k 4,8,16,32 --s $s -p 0 -n 128 -r 2 > $O/c/refined_${q}_s$s.md 2>&1; rc=$?
  echo "[$(el)s] $q s=$s rc=$rc"; grep -E '^\| f16 \| tg128' $O/c/refined_${q}_s$s.md
done; done
timeout 400 $S test-backend --device cuda > $O/c/test_backend.md 2>&1; rc=$?
echo "[$(el)s] conformance rc=$rc: $(grep 'cases on cuda' $O/c/test_backend.md)"
grep -E '^\| [a-z_]+ \|' $O/c/test_backend.md | grep -v -e '| ok |' -e '^| op |' | cut -c1-300
tar czf $O/c.tgz -C $O c && rm -rf $O/c
echo "total $(el) s"
