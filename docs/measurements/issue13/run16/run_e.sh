#!/bin/bash
# Call E (session 59): the first H200 loan in five sessions. The build is ebd54a9 with
# run15/batched_prologue.patch applied. While llama.cpp 0c1e570 builds: the whole conformance
# suite on this card. Then one side-by-side on the Llama-3.1-8B shape: llama.cpp's Q2_K /
# Q4_K_M / Q4_0 and ours (group, trellis under both rotations, look-up-table and GGUF-block
# codes), tg128 and pp512; then per-kernel decode times of qtip2 HYB b128.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/e $O/e
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/e/sfx; chmod +x /tmp/e/sfx; S=/tmp/e/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/e/gpu.txt
(QUANTS="q2_k q4_k_m q4_0" DEADLINE=0 OUT=$O/e/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
timeout 300 $S test-backend --device cuda --seed 24 > $O/e/conf.md 2>&1
echo "[$(el)s] whole suite rc=$?: $(grep 'cases on cuda' $O/e/conf.md)"
grep -E '^\| [a-z_]+ \|' $O/e/conf.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head -20
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=500 OUT=$O/e/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/e/peer/llamacpp_bench.md
for f in rtn2 qtip2:hyb:b128 qtip2:hyb:full qtip2:1mad:b128 qtip3:hyb:b128 qtip3:hyb:full qtip4:hyb:b128 qtip4:hyb:full rtn3 rtn4 q2_k sqllm3 sqllm4 q4_k q4_0 qtip2:1mad:full; do
  [ $(el) -gt 560 ] && { echo "skip $f: past 560 s"; continue; }
  IFS=: read -r q code rot <<< "$f"
  args=(); [ -n "$code" ] && args=(--trellis-code "$code" --rotation "$rot")
  tag=${f//:/_}
  timeout 45 $S bench --synthetic llama-3.1-8b --device cuda --quant "$q" "${args[@]}" -p 512 -n 128 -r 3 > $O/e/bench_$tag.md 2>&1
  echo "[$(el)s] $f: $(grep -E '^\| llama' $O/e/bench_$tag.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
[ $(el) -lt 575 ] && { SFX_PROFILE_KERNELS=1 timeout 20 $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --rotation b128 -p 0 -n 16 -r 1 --graphs off > $O/e/profile_b128.md 2> $O/e/profile_b128.err; echo "[$(el)s] profile rc=$?"; }
rm -f $O/e/peer/*.gguf
tar czf $O/e.tgz -C $O e && rm -rf $O/e
echo "total $(el) s"
