#!/bin/bash
# Issue 14, third slice, call A: the landed main (cad5c6a; its last GPU-touching commit b72fa4b
# never ran on the H200) — the whole conformance suite, then the baseline this slice starts
# from: rtn2 and qtip2 refined at k = 4 and 16 (s = 0 and s = 1), and the per-kernel profile
# of a refined rtn2 token (step graphs off, every launch timed).
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/b; xz -dc .gpu/main.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
timeout 300 $B test-backend --device cuda > $O/test_backend_all.md 2>&1
echo "suite rc=$?: $(grep 'cases on cuda' $O/test_backend_all.md)"; grep -E "FAIL" $O/test_backend_all.md | head -5
echo "t=$(( $(date +%s) - t0 ))"
for q in rtn2 qtip2; do for s in 0 1; do
  timeout 150 $B bench $M --quant $q --fit --k 4,16 --s $s -p 0 -n 128 -r 3 > $O/bench_${q}_s$s.md 2>&1
  echo "$q s=$s"; grep -E "tg128" $O/bench_${q}_s$s.md | cut -c1-200
done; done
echo "t=$(( $(date +%s) - t0 ))"
SFX_PROFILE_KERNELS=1 timeout 150 $B bench $M --quant rtn2 --fit --k 4 --graphs off -p 0 -n 32 -r 1 > $O/profile_rtn2_k4.md 2> $O/profile_rtn2_k4.err
grep tg32 $O/profile_rtn2_k4.md | cut -c1-200; head -40 $O/profile_rtn2_k4.err
echo "total $(( $(date +%s) - t0 )) s"
