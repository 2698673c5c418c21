#!/bin/bash
# Issue 14, fourth slice, call G: the trellis finish reads fetch lead's staged operand ahead too
# (column pieces, selection and scales by cp.async before the launch waits for the matvec; the
# norm's scale once for gate and up), against call E's build (9011101). Conformance first, then
# two alternating rounds of qtip2 (k = 1, 4, 16 under lead/lag) and one of rtn2, then per-kernel
# times of qtip2 k = 1 (graphs off).
# Binaries: .gpu/ahead.xz (9011101), .gpu/trellis.xz (this build).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/g; for n in ahead trellis; do xz -dc .gpu/$n.xz > /tmp/g/$n; chmod +x /tmp/g/$n; done
timeout 100 /tmp/g/trellis test-backend --device cuda --op model_decode --op refined --op lead > $O/test_backend.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend.md)"; grep -E "FAIL" $O/test_backend.md | cut -c1-150 | head -8
grep -E "hyb-q9.*staged" $O/test_backend.md | cut -c1-150
echo "t=$(( $(date +%s) - t0 ))"
for round in 1 2; do for n in ahead trellis; do
  timeout 60 /tmp/g/$n bench $M --quant qtip2 --fit --k 1,4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > /tmp/g/b.md 2>&1
  echo "round $round qtip2 $n t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" /tmp/g/b.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" /tmp/g/b.md
done; done
for n in ahead trellis; do
  timeout 60 /tmp/g/$n bench $M --quant rtn2 --fit --k 4 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > /tmp/g/b.md 2>&1
  echo "rtn2 $n t=$(( $(date +%s) - t0 ))"; grep -E "\| - \| tg128" /tmp/g/b.md | awk -F'|' '{print "base", $10}'; grep -E "^\| f16 \| tg128" /tmp/g/b.md
done
SFX_PROFILE_KERNELS=1 timeout 60 /tmp/g/trellis bench $M --quant qtip2 --fit --k 1 --s 1,0.5,1,0.5 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2_k1_lead.txt
echo "total $(( $(date +%s) - t0 )) s"
