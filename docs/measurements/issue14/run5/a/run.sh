#!/bin/bash
# Issue 14, fifth slice, call A: the wide-preset refined decode cases (44efdc7) on a GPU five
# times with HEAD's build, then the two kernel patches kept in run4/pending, each A/B against
# HEAD in two alternating rounds (k = 1, 4, 16 under s = 1,0.5,1,0.5; × the base of the same
# process): swiglu3 (__launch_bounds__(256, 3) on the one-tile SwiGLU _rf entries) with rtn2,
# trv2 (the trellis finish reads fetch lead's staged operand ahead, a thread per byte) with qtip2.
# Binaries: .gpu/head.xz (0bcee83), .gpu/swiglu3.xz, .gpu/trv2.xz (HEAD + each patch).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/a; for n in head swiglu3 trv2; do xz -dc .gpu/$n.xz > /tmp/a/$n; chmod +x /tmp/a/$n; done
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 150 /tmp/a/head test-backend --device cuda --op model_decode --op refined --op lead > $O/test_backend_head.md 2>&1
echo "head suite rc=$?: $(grep 'cases on cuda' $O/test_backend_head.md)"; grep FAIL $O/test_backend_head.md | cut -c1-160 | head -8
for i in 2 3 4 5; do
  timeout 60 /tmp/a/head test-backend --device cuda --op model_decode > $O/model_decode_$i.md 2>&1
  echo "model_decode run $i rc=$?: $(grep 'cases on cuda' $O/model_decode_$i.md)"; grep FAIL $O/model_decode_$i.md | cut -c1-160 | head -4
done
echo "t=$(( $(date +%s) - t0 ))"
timeout 100 /tmp/a/swiglu3 test-backend --device cuda --op refined --op group --op lead > $O/test_backend_swiglu3.md 2>&1
echo "swiglu3 suite rc=$?: $(grep 'cases on cuda' $O/test_backend_swiglu3.md)"; grep FAIL $O/test_backend_swiglu3.md | cut -c1-160 | head -4
timeout 100 /tmp/a/trv2 test-backend --device cuda --op trellis --op refined --op lead > $O/test_backend_trv2.md 2>&1
echo "trv2 suite rc=$?: $(grep 'cases on cuda' $O/test_backend_trv2.md)"; grep FAIL $O/test_backend_trv2.md | cut -c1-160 | head -4
echo "t=$(( $(date +%s) - t0 ))"
row() { grep -E "\| - \| tg128" $1 | awk -F'|' '{printf "base %s", $10}'; grep -E "^\| f16 \| tg128" $1 | awk -F'|' '{printf " |%s%s%s", $4, $5, $6}'; echo; }
for round in 1 2; do
  for n in head swiglu3; do
    timeout 60 /tmp/a/$n bench $M --quant rtn2 --fit --k 1,4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > $O/bench_rtn2_${n}_r$round.md 2>&1
    echo "round $round rtn2 $n: $(row $O/bench_rtn2_${n}_r$round.md)"
  done
  for n in head trv2; do
    timeout 60 /tmp/a/$n bench $M --quant qtip2 --fit --k 1,4,16 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > $O/bench_qtip2_${n}_r$round.md 2>&1
    echo "round $round qtip2 $n: $(row $O/bench_qtip2_${n}_r$round.md)"
  done
done
echo "total $(( $(date +%s) - t0 )) s"
