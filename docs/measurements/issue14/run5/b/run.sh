#!/bin/bash
# Issue 14, fifth slice, call B: why the wide-preset refined decode cases fail on CUDA (call A:
# every k = 128 case by 5e-2, the coded k = 64 s = 0 cases now and then just past 3e-3).
# Then trv2's base again, in the other order.
# diag = HEAD + a throwaway op `model_diag` (tiny-wide f32, k and s varied one at a time; the
# coded refined cases with a one-token prompt, no tensor-core prefill).
O=$OUT; t0=$(date +%s); mkdir -p /tmp/b $O/b
xz -dc .gpu/diag.xz > /tmp/b/diag; chmod +x /tmp/b/diag
for i in 1; do
  timeout 120 /tmp/b/diag test-backend --device cuda --op model_diag > $O/b/diag_$i.md 2>&1
  echo "diag $i rc=$?: $(grep 'cases on cuda' $O/b/diag_$i.md)"; grep model_diag $O/b/diag_$i.md | cut -d'|' -f3,5,6,7
done
for i in 1; do
  timeout 60 /tmp/b/diag test-backend --device cuda --op model_decode > $O/b/decode_$i.md 2>&1
  echo "model_decode $i rc=$?: $(grep 'cases on cuda' $O/b/decode_$i.md)"
done
grep -h "model_decode" $O/b/decode_*.md | cut -d'|' -f3,5,6,7 | sort | awk -F'|' '{k=$1; a[k]=a[k] " " $3} END {for (k in a) print k ":" a[k]}'
# call A measured trv2's base 1.1 % below head's with trv2 always last in a round: the same
# bases in the other order (trv2 first), then refined k = 4 of both.
for n in head trv2; do xz -dc .gpu/$n.xz > /tmp/b/$n; chmod +x /tmp/b/$n; done
M="--synthetic llama-3.1-8b --device cuda"
for round in 1; do for n in trv2 head; do
  timeout 60 /tmp/b/$n bench $M --quant qtip2 -p 0 -n 128 -r 3 > $O/b/base_${n}_r$round.md 2>&1
  echo "round $round qtip2 base $n: $(grep -E 'tg128' $O/b/base_${n}_r$round.md | awk -F'|' '{print $10}')"
done; done
for n in trv2 head; do
  timeout 60 /tmp/b/$n bench $M --quant qtip2 --fit --k 4 --s 1,0.5,1,0.5 -p 0 -n 128 -r 2 > $O/b/k4_${n}.md 2>&1
  echo "qtip2 k4 $n: $(grep -E '^\| f16 \| tg128' $O/b/k4_${n}.md)"
done
tar czf $O/b.tgz -C $O b && rm -rf $O/b
echo "total $(( $(date +%s) - t0 )) s"
