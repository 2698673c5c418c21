#!/bin/bash
# Call A (prepared in session 60, when no device was lent; to run in the next session): the
# trellis matvec finishing block-rotated outputs itself (matvec_epilogue: a ticket per row
# block, the last contributing block transforms it) instead of a tr_finish launch per
# projection set, behind SFX_TR_EPILOGUE=1 until this call has checked and measured it.
# While llama.cpp 0c1e570 builds: trellis and whole-model conformance with the epilogue on
# and off at one seed (the errors should be identical: same arithmetic, same order); issue
# 17's seed-21 GGUF Q2_K model case with our f32 GEMM in place of cuBLAS's TF32 panels. Then
# SFX_TR_EPILOGUE=0 against =1, alternating, tg128; llama.cpp Q2_K and ours side by side; the
# per-kernel decode times of qtip2 HYB b128 with the epilogue.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/a $O/a
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/a/sfx; chmod +x /tmp/a/sfx; S=/tmp/a/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/a/gpu.txt
(QUANTS="q2_k" DEADLINE=0 OUT=$O/a/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
for e in 1 0; do
  SFX_TR_EPILOGUE=$e timeout 150 $S test-backend --device cuda --op trellis --op model_decode --seed 21 > $O/a/conf_e$e.md 2>&1
  echo "[$(el)s] trellis + model_decode, SFX_TR_EPILOGUE=$e rc=$?: $(grep 'cases on cuda' $O/a/conf_e$e.md)"
  grep -E '^\| [a-z_]+ \|' $O/a/conf_e$e.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head -20
done
diff <(grep -E '^\| trellis' $O/a/conf_e1.md | cut -d'|' -f2-6) <(grep -E '^\| trellis' $O/a/conf_e0.md | cut -d'|' -f2-6) > $O/a/e0_vs_e1.diff && echo "trellis cases: identical errors with and without the epilogue ($(grep -cE '^\| trellis' $O/a/conf_e1.md) cases)" || echo "trellis cases differ: $(wc -l < $O/a/e0_vs_e1.diff) diff lines"
# Issue 17's seed-21 GGUF Q2_K model case: is it the TF32 prefill?
SFX_CUDA_GEMM=own timeout 90 $S test-backend --device cuda --op model_decode --seed 21 > $O/a/conf_own_gemm.md 2>&1
echo "[$(el)s] model_decode, SFX_CUDA_GEMM=own rc=$?: $(grep 'cases on cuda' $O/a/conf_own_gemm.md)"
grep -E 'gguf|lut' $O/a/conf_own_gemm.md | cut -d'|' -f2,3,5,6,7 | cut -c1-200
grep -E 'gguf|lut' $O/a/conf_e0.md | cut -d'|' -f2,3,5,6,7 | cut -c1-200
bench() { # tag env-and-command...
  local tag=$1; shift
  timeout 45 env "$@" > $O/a/bench_$tag.md 2>&1
  echo "[$(el)s] $tag: $(grep -E '^\| llama' $O/a/bench_$tag.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
}
for round in 1 2; do
  fs="qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb"; [ $round = 2 ] && fs="qtip2:hyb qtip2:1mad"
  for f in $fs; do
    IFS=: read -r q code <<< "$f"
    for e in 0 1; do
      bench "ab${round}_${q}_${code}_e$e" SFX_TR_EPILOGUE=$e $S bench --synthetic llama-3.1-8b --device cuda --quant $q --trellis-code $code --rotation b128 -p 0 -n 128 -r 3
    done
  done
done
bench rows2_qtip2_hyb SFX_TR_EPILOGUE=1 SFX_TR_ROWS=2 $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --trellis-code hyb --rotation b128 -p 0 -n 128 -r 3
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=500 OUT=$O/a/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/a/peer/llamacpp_bench.md
for f in rtn2 qtip2:hyb qtip2:1mad; do
  [ $(el) -gt 540 ] && { echo "skip $f: past 540 s"; continue; }
  IFS=: read -r q code <<< "$f"
  args=(); [ -n "$code" ] && args=(--trellis-code "$code" --rotation b128)
  bench "sbs_${f//:/_}" SFX_TR_EPILOGUE=1 $S bench --synthetic llama-3.1-8b --device cuda --quant "$q" "${args[@]}" -p 512 -n 128 -r 3
done
# llama.cpp's Q2_K file keeps its head in Q6_K (6.56 bits): ours with a 6-bit head, like for like.
[ $(el) -lt 545 ] && bench sbs_qtip2_hyb_q6head SFX_TR_EPILOGUE=1 $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --trellis-code hyb --rotation b128 --head q6 -p 512 -n 128 -r 3
[ $(el) -lt 570 ] && { SFX_TR_EPILOGUE=1 SFX_PROFILE_KERNELS=1 timeout 20 $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --rotation b128 -p 0 -n 16 -r 1 --graphs off > $O/a/profile_b128.md 2> $O/a/profile_b128.err; echo "[$(el)s] profile rc=$?"; }
rm -f $O/a/peer/*.gguf
tar czf $O/a.tgz -C $O a && rm -rf $O/a
echo "total $(el) s"
