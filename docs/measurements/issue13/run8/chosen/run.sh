#!/bin/bash
# Call B, right after call A (run14.sh) on the same machine: picks the tile plan (best summed
# tg128 ratio of rtn4 and rtn2 to the default, among plans whose conformance passed) and the
# trellis binary (new3 where the batched mix passed conformance and beat new2 by > 1 %), then:
# full conformance, llama.cpp Q2_K / Q4_K_M / Q4_0 and every sfx format back to back, and
# per-kernel decode times of rtn4 and qtip2.
O=$OUT; R=/tmp/run14; M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
PLAN=1,3,1; BIN=new2
if [ -s $R/plans.md ]; then
  PLAN=$(awk '/^plan 1,3,1/{a0=0;n=0;for(i=4;i<=NF&&$i!="rtn2";i++){a0+=$i;n++};a0/=n;b0=0;m=0;for(;i<=NF;i++)if($i+0>0){b0+=$i;m++};b0/=m}
    {p[NR]=$2; a=0;n=0;for(i=4;i<=NF&&$i!="rtn2";i++){a+=$i;n++}; ra[NR]=(n?a/n:0); b=0;m=0;for(;i<=NF;i++)if($i+0>0){b+=$i;m++}; rb[NR]=(m?b/m:0)}
    END{best="1,3,1";bs=2;for(k in p){s=ra[k]/a0+rb[k]/b0; if(s>bs+0.01){bs=s;best=p[k]}}; print best}' $R/plans.md)
  grep -q "FAIL\|0 passed" $R/group_conformance.txt && PLAN=1,3,1
  grep -c " 0 failed" $R/group_conformance.txt
fi
if [ -s $R/ab_b16.md ] && ! grep -q "FAIL" $R/b16_conformance.txt && [ "$(grep -c ' 0 failed' $R/b16_conformance.txt)" = 4 ]; then
  BIN=$(awk '{print (($4+$5)/2 > 1.01*($7+$8)/2) ? "new3" : "new2"}' $R/ab_b16.md)
fi
echo "chosen: plan $PLAN binary $BIN" | tee $O/chosen.txt
mkdir -p /tmp/final; [ -x /tmp/$BIN/sfx ] || xz -dc .gpu/xz/$BIN.xz > /tmp/$BIN/sfx; cp /tmp/$BIN/sfx /tmp/final/sfx; S=/tmp/final/sfx
chmod +x $S; export SFX_GT_PLAN=$PLAN
PEER_QUANTS="q2_k q4_k_m q4_0" BIN=/tmp/final PEER=$PWD/.peers/llamacpp OUT=/tmp/peerout bash scripts/gpu/side_by_side.sh prepare
timeout 240 $S test-backend --device cuda > $O/test_backend_cuda.md 2>&1
grep "cases on cuda" $O/test_backend_cuda.md; grep -E "\| FAIL" $O/test_backend_cuda.md | head -5
echo "conformance $(( $(date +%s) - t0 )) s"
while pgrep -f device_bench.sh >/dev/null; do sleep 3; done
echo "peer built $(( $(date +%s) - t0 )) s"
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=400 OUT=$O bash .peers/llamacpp/device_bench.sh >/dev/null 2>&1
grep -E "tg128|pp512" $O/llamacpp_bench.md | awk -F'|' '{print $2, $8, $9}'
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb; do
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 120 $S bench $M --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 2>&1 | grep -E '^\| llama|rror'
done | tee $O/sfx_bench_formats.md | awk -F'|' '{print $2, $8, $9, $10}'
for q in rtn4 qtip2; do
  SFX_PROFILE_KERNELS=1 timeout 100 $S bench $M --quant $q -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_$q.err
done
grep -E '^\| ' $O/profile_rtn4.err | head -8
echo "total $(( $(date +%s) - t0 )) s"
