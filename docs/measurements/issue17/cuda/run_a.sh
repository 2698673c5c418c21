#!/bin/bash
# Call A (session 56): the CUDA kernels of look-up-table codes and GGUF blocks (issue 17).
# Two builds: .gpu/sfx.xz (v1, e7279aa: codes → floats by OR into 2^23 and a subtraction)
# and .gpu/sfx2.xz (v2: codes rotated into the top of an f32 mantissa, f = 1 + q·2^-B; the K-quants
# with high-bit planes one chunk in flight). While llama.cpp builds: v2's new ops against the
# CPU reference (projections, fused q/k/v and gate/up, embeddings, whole models), v1's, then
# v2's whole suite. Then the 8B-shape side-by-side: llama.cpp (Q2_K / Q4_K_M / Q4_0) and
# `sfx bench --synthetic llama-3.1-8b` of both builds in the same command, back to back.
# Run from the repository root with .gpu and .peers carried.
# END: seconds after which no new benchmark starts (the device budget decides it).
END=${END:-470}
O=$OUT; t0=$(date +%s); mkdir -p /tmp/a $O/a
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/a/sfx1; xz -dc .gpu/sfx2.xz > /tmp/a/sfx2; chmod +x /tmp/a/sfx1 /tmp/a/sfx2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
(QUANTS="q2_k q4_k_m q4_0" DEADLINE=0 OUT=$O/a/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
summary() { echo "[$(el)s] $1 rc=$2: $(grep 'cases on cuda' $3)"; grep -E '^\| [a-z_]+ \|' $3 | grep -v -e '| ok |' -e '^| op |' | cut -c1-240 | head -${4:-20}; }
for v in 2 1; do
  timeout 90 /tmp/a/sfx$v test-backend --device cuda --op coded_ --op gguf_linear --op lut_linear --op group_embedding --seed 1 > $O/a/conf_coded_v$v.md 2>&1
  summary "v$v coded ops" $? $O/a/conf_coded_v$v.md 30
done
timeout 90 /tmp/a/sfx2 test-backend --device cuda --op model_decode --seed 1 > $O/a/conf_models.md 2>&1
summary "v2 model_decode" $? $O/a/conf_models.md
left=$(( 190 - $(el) )); [ $left -lt 40 ] && left=40
timeout $left /tmp/a/sfx2 test-backend --device cuda --seed 2 > $O/a/conf_all.md 2>&1
summary "v2 whole suite seed 2 (timeout ${left}s)" $? $O/a/conf_all.md
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=600 OUT=$O/a/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/a/peer/llamacpp_bench.md
for f in q2_k:2 q4_k:2 q4_k:1 sqllm3:2 q4_0:2 rtn2:2 q6_k:2 sqllm4:2 q2_k:1 sqllm3:1 q3_k:2 q5_k:2; do
  [ $(el) -gt $END ] && { echo "skip $f: past $END s"; continue; }
  q=${f%%:*}; v=${f##*:}
  timeout 40 /tmp/a/sfx$v bench --synthetic llama-3.1-8b --device cuda --quant $q -p 512 -n 128 -r 3 > $O/a/bench_${q}_v$v.md 2>&1
  echo "[$(el)s] $q v$v rc=$?: $(grep -E '^\| llama' $O/a/bench_${q}_v$v.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
rm -f $O/a/peer/*.gguf
tar czf $O/a.tgz -C $O a && rm -rf $O/a
echo "total $(el) s"
