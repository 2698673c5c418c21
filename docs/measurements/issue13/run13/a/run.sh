#!/bin/bash
# Issue 13, thirteenth slice, call A: a decode token's trellis MLP as one persistent cooperative
# launch (tr_mlp: gate/up matvec, SwiGLU finish, down prepare, down matvec, down finish between
# grid barriers) against the five launches (SFX_TR_MLP=0, same binary): conformance of every
# trellis op (the transform bodies now take row-block teams), tg128 A/B, per-kernel times.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
mkdir -p /tmp/b; xz -dc .gpu/mlp.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; B=/tmp/b/sfx
timeout 200 $B test-backend --device cuda --op trellis_mlp --op model_decode > $O/test_backend_mlp.md 2>&1
echo "mlp+decode: $(grep 'cases on cuda' $O/test_backend_mlp.md)"; grep -E "FAIL|fail|rror" $O/test_backend_mlp.md | head -8
tg() { timeout 60 env $1 $B bench $M --quant $2 -p 0 -n 128 -r 3 "${@:3}" 2>&1 | tee -a $O/bench_raw.txt | grep tg128 | awk -F'|' '{print $10}' | awk '{print $1}' | tr '\n' ' '; }
for round in 1 2; do
  for f in qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
    code=(--trellis-code "${f##*:}"); q=${f%%:*}
    echo "$f r$round five $(tg SFX_TR_MLP=0 $q "${code[@]}") mlp $(tg SFX_TR_MLP=1 $q "${code[@]}")"
  done
done | tee $O/ab_mlp.md
tail -5 $O/bench_raw.txt
SFX_PROFILE_KERNELS=1 timeout 60 $B bench $M --quant qtip2 -p 0 -n 16 -r 1 --graphs off > /dev/null 2> $O/profile_qtip2_mlp.err
grep -E "tr_" $O/profile_qtip2_mlp.err | head -12
timeout 250 $B test-backend --device cuda --op trellis > $O/test_backend_trellis.md 2>&1
echo "trellis: $(grep 'cases on cuda' $O/test_backend_trellis.md)"; grep -E "FAIL|fail" $O/test_backend_trellis.md | head -5
echo "total $(( $(date +%s) - t0 )) s"
