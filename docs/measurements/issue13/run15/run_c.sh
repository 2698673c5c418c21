#!/bin/bash
# Call C (session 58, not run: no device came): the build with batched_prologue.patch applied
# (the block-rotation prologue batches its loads). While llama.cpp builds: trellis and
# model-decode conformance. Then issue 13's side-by-side in one command: llama.cpp (0c1e570,
# Q2_K / Q4_K_M / Q4_0) and the trellis formats under both rotations, tg128 and pp512.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/c $O/c
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/c/sfx; chmod +x /tmp/c/sfx; S=/tmp/c/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/c/gpu.txt
(QUANTS="q2_k q4_k_m q4_0" DEADLINE=0 OUT=$O/c/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
timeout 150 $S test-backend --device cuda --op trellis --op model_decode --seed 22 > $O/c/conf.md 2>&1
echo "[$(el)s] trellis + model_decode rc=$?: $(grep 'cases on cuda' $O/c/conf.md)"
grep -E '^\| [a-z_]+ \|' $O/c/conf.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head -20
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=600 OUT=$O/c/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/c/peer/llamacpp_bench.md
for f in rtn2 qtip2:hyb:b128 qtip2:hyb:full qtip2:1mad:b128 qtip3:hyb:b128 qtip3:hyb:full qtip4:hyb:b128 rtn4 qtip4:hyb:full qtip2:1mad:full; do
  [ $(el) -gt 540 ] && { echo "skip $f: past 540 s"; continue; }
  IFS=: read -r q code rot <<< "$f"
  args=(); [ -n "$code" ] && args=(--trellis-code "$code" --rotation "$rot")
  tag=${f//:/_}
  timeout 60 $S bench --synthetic llama-3.1-8b --device cuda --quant "$q" "${args[@]}" -p 512 -n 128 -r 3 > $O/c/bench_$tag.md 2>&1
  echo "[$(el)s] $f: $(grep -E '^\| llama' $O/c/bench_$tag.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
for rot in b128 full; do
  [ $(el) -gt 570 ] && continue
  SFX_PROFILE_KERNELS=1 timeout 30 $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --rotation $rot -p 0 -n 16 -r 1 --graphs off > $O/c/profile_$rot.md 2> $O/c/profile_$rot.err
  echo "[$(el)s] profile $rot rc=$?"
done
rm -f $O/c/peer/*.gguf
tar czf $O/c.tgz -C $O c && rm -rf $O/c
echo "total $(el) s"
