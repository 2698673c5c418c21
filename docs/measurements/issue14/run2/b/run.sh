#!/bin/bash
# Issue 14, second slice, call B: fetch lead and lag on two branch lanes (near: the work joined
# after its projection; far: lead's staging and lag's fetches), so the slow bus fetches never
# hold up a near join. Conformance, then tg128 of the Llama-3.1-8B shape with synthetic
# refinement at k = 4, 8, 16, 32 (all sets), s = 0 / 0.5 / 1, rtn2 and qtip2 HYB; lead only and
# lag only for rtn2.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/b; xz -dc .gpu/lead.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
timeout 120 $B test-backend --device cuda --op lead_columns --op add_selected_columns --op model_decode > $O/test_backend_refine.md 2>&1
echo "conformance: $(grep 'cases on cuda' $O/test_backend_refine.md)"; grep -E "FAIL|fail" $O/test_backend_refine.md | head -5
run() { timeout 150 $B bench $M --quant $1 --fit --k $2 --s $3 -p 0 -n 128 -r 3 > $O/b.md 2> $O/b.err; grep -E "^\| f16 \| tg128 \| k" $O/b.md | sed "s/^/$1 /"; grep -iE "error|panic" $O/b.err | head -3; cat $O/b.md >> $O/bench_all.md; }
for q in rtn2 qtip2; do
  for s in 0 0.5 1 2; do run $q 4,8,16,32 $s; done
done
run rtn2 4,16 1,0,1,0
run rtn2 4,16 0,1,0,1
grep -E "^\| .*synthetic.* \| - \| tg128" $O/bench_all.md | awk -F'|' '{print $2, $10}' | sort -u
rm -f $O/b.md $O/b.err
echo "total $(( $(date +%s) - t0 )) s"
