#!/bin/bash
# Issue 14 sixth slice, call E: the whole conformance suite on the session's last build
# (ade23a1: the coded refined decode cases decode-only at 3e-3), then the read-ahead's base
# recheck left from the fifth slice (its build measured qtip2's base 1.1 % below 0bcee83's,
# always running last in a round): final (whose trellis kernels are the read-ahead's) first,
# then head (0bcee83), two rounds.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/e $O/e
el() { echo $(( $(date +%s) - t0 )); }
for n in final head; do xz -dc .gpu/$n.xz > /tmp/e/$n; chmod +x /tmp/e/$n; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 300 /tmp/e/final test-backend --device cuda > $O/e/test_backend.md 2>&1; rc=$?
echo "[$(el)s] conformance rc=$rc: $(grep -m1 -o 'seed [0-9]*' $O/e/test_backend.md) $(grep 'cases on cuda' $O/e/test_backend.md)"
grep -E '^\| [a-z_]+ \|' $O/e/test_backend.md | grep -v -e '| ok |' -e '^| op |' | cut -c1-300
for round in 1 2; do for n in final head; do
  timeout 60 /tmp/e/$n bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 128 -r 3 > $O/e/base_${n}_r$round.md 2>&1
  echo "[$(el)s] round $round qtip2 base $n: $(grep -E 'tg128' $O/e/base_${n}_r$round.md | awk -F'|' '{print $10}')"
done; done
tar czf $O/e.tgz -C $O e && rm -rf $O/e
echo "total $(el) s"
