#!/bin/bash
# Call A (session 57): the GPU checks owed by session 56 — the coded kernels after the
# recentred GGUF test data (dc48604), the shared gather row count (46176bb), the name-derived
# kernel index and row_values tables (865293d) and the dequant path's code → float step now
# shared with the matvec (this session). The new coded ops and whole models first, then the
# whole suite. Run from the repository root with .gpu carried.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/a $O/a
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/a/sfx; chmod +x /tmp/a/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
summary() { echo "[$(el)s] $1 rc=$2: $(grep 'cases on cuda' $3)"; grep -E '^\| [a-z_]+ \|' $3 | grep -v -e '| ok |' -e '^| op |' | cut -c1-240 | head -${4:-20}; }
timeout 120 /tmp/a/sfx test-backend --device cuda --op coded_ --op gguf_linear --op lut_linear --op embedding --op model_decode --seed 7 > $O/a/conf_coded.md 2>&1
summary "coded ops + model_decode seed 7" $? $O/a/conf_coded.md 30
timeout 300 /tmp/a/sfx test-backend --device cuda --seed 8 > $O/a/conf_all.md 2>&1
summary "whole suite seed 8" $? $O/a/conf_all.md 30
for q in q4_k sqllm3 q2_k; do
  timeout 40 /tmp/a/sfx bench --synthetic llama-3.1-8b --device cuda --quant $q -p 512 -n 128 -r 3 > $O/a/bench_$q.md 2>&1
  echo "[$(el)s] $q rc=$?: $(grep -E '^\| llama' $O/a/bench_$q.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
gzip -9 $O/a/conf_all.md
tar czf $O/a.tgz -C $O a && rm -rf $O/a
echo "total $(el) s"
