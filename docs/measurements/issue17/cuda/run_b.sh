#!/bin/bash
# Call B (session 56): the CUDA-core matvec bodies of group.cu and coded.cu share their x
# staging, norm scale and row-set reduction (row_matvec.cuh). .gpu/sfx2.xz = before (9839014),
# .gpu/sfx3.xz = after. The after build's group and coded ops against the CPU, then both
# builds back to back on the 8B shape: q2_k and sqllm3 (coded.cu, q8 head on group.cu's file
# layout) and rtn3 on the file layout (SFX_GROUP_TILES=0).
O=$OUT; t0=$(date +%s); mkdir -p /tmp/b $O/b
el() { echo $(( $(date +%s) - t0 )); }
for v in 2 3; do xz -dc .gpu/sfx$v.xz > /tmp/b/sfx$v; chmod +x /tmp/b/sfx$v; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 100 /tmp/b/sfx3 test-backend --device cuda --op group_ --op coded_ --op matmul_t_group --op rms_norm_matmul --op model_decode --seed 3 > $O/b/conf.md 2>&1
echo "[$(el)s] conformance rc=$?: $(grep 'cases on cuda' $O/b/conf.md)"
grep -E '^\| [a-z_]+ \|' $O/b/conf.md | grep -v -e '| ok |' -e '^| op |' | cut -c1-220 | head
for f in q2_k:2 q2_k:3 sqllm3:2 sqllm3:3 rtn3:2 rtn3:3 q2_k:2 q2_k:3; do
  [ $(el) -gt ${END:-170} ] && { echo "skip $f"; continue; }
  q=${f%%:*}; v=${f##*:}; env=(); [ $q = rtn3 ] && env=(SFX_GROUP_TILES=0)
  env "${env[@]}" timeout 30 /tmp/b/sfx$v bench --synthetic llama-3.1-8b --device cuda --quant $q -p 0 -n 128 -r 3 > $O/b/bench_${q}_v$v.md 2>&1
  echo "[$(el)s] $q v$v: $(grep -E '^\| llama' $O/b/bench_${q}_v$v.md | awk -F'|' '{print $9 $10 $11}')"
done
tar czf $O/b.tgz -C $O b && rm -rf $O/b
