#!/bin/bash
# Issue 14, second slice, call D: selections on the near lane (lead's read the residual stream,
# joined before the next residual add; lag's read the projection's input), only the bus
# transfers on the far lane — call C's conformance found lead/lag decode steps diverging on
# CUDA (a far-lane selection read the stream after the main stream had added into it).
# Conformance with branches and in order, then the k ladder at s = 0, 0.5, 1.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/b; xz -dc .gpu/final.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
timeout 120 $B test-backend --device cuda --op model_decode --op lead_columns --op add_selected_columns --op select_channels > $O/test_backend_refine.md 2>&1
echo "branches: $(grep 'cases on cuda' $O/test_backend_refine.md)"; grep -E "refined" $O/test_backend_refine.md
SFX_BRANCHES=0 timeout 120 $B test-backend --device cuda --op model_decode > $O/test_backend_in_order.md 2>&1
echo "in order: $(grep 'cases on cuda' $O/test_backend_in_order.md)"; grep -E "FAIL" $O/test_backend_in_order.md | head -3
for q in rtn2 qtip2; do for s in 0 0.5 1; do
  timeout 150 $B bench $M --quant $q --fit --k 4,8,16,32 --s $s -p 0 -n 128 -r 3 > $O/b.md 2>/dev/null
  grep -E "^\| f16 \| tg128 \| k" $O/b.md | sed "s/^/$q /"; grep -E "synthetic.* \| - \| tg128" $O/b.md | awk -F'|' '{print "base", $10}'; cat $O/b.md >> $O/bench_all.md
done; done
rm -f $O/b.md
echo "total $(( $(date +%s) - t0 )) s"
