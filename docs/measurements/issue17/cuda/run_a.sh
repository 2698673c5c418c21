#!/bin/bash
# Call A (session 56): the CUDA kernels of look-up-table codes and GGUF blocks (issue 17).
# While llama.cpp builds: those ops against the CPU reference (projections, fused q/k/v and
# gate/up, embeddings, whole models), then the whole suite. Then the 8B-shape side-by-side:
# llama.cpp (Q2_K / Q4_K_M / Q4_0) and `sfx bench --synthetic llama-3.1-8b` in the same
# command, back to back. Run from the repository root with .gpu/sfx.xz and .peers carried.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/a $O/a
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/a/sfx; chmod +x /tmp/a/sfx; S=/tmp/a/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
(QUANTS="q2_k q4_k_m q4_0" DEADLINE=0 OUT=$O/a/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
summary() { echo "[$(el)s] $1 rc=$2: $(grep 'cases on cuda' $3)"; grep -E '^\| [a-z_]+ \|' $3 | grep -v -e '| ok |' -e '^| op |' | cut -c1-260 | head -${4:-25}; }
timeout 120 $S test-backend --device cuda --op coded_ --op gguf_linear --op lut_linear --op group_embedding --seed 1 > $O/a/conf_coded.md 2>&1
summary "coded ops" $? $O/a/conf_coded.md 40
timeout 120 $S test-backend --device cuda --op model_decode --seed 1 > $O/a/conf_models.md 2>&1
summary "model_decode" $? $O/a/conf_models.md
timeout 150 $S test-backend --device cuda --seed 2 > $O/a/conf_all.md 2>&1
summary "whole suite seed 2" $? $O/a/conf_all.md
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=600 OUT=$O/a/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/a/peer/llamacpp_bench.md
for f in q2_k q4_k sqllm3 q4_0 sqllm4 q3_k q6_k rtn2 qtip2; do
  [ $(el) -gt 565 ] && { echo "skip $f: past 565 s"; continue; }
  timeout 45 $S bench --synthetic llama-3.1-8b --device cuda --quant $f -p 512 -n 128 -r 3 > $O/a/bench_$f.md 2>&1
  echo "[$(el)s] $f rc=$?: $(grep -E '^\| llama' $O/a/bench_$f.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
rm -f $O/a/peer/*.gguf
tar czf $O/a.tgz -C $O a && rm -rf $O/a
echo "total $(el) s"
