#!/bin/bash
# Call B (session 58), the lean form of run_a.sh (no llama.cpp: rtn2 is the same-call control,
# 2.07–2.09 × llama.cpp Q2_K in every earlier side-by-side): trellis and model-decode
# conformance (the block-rotation cases are new), then the 8B shape's tg128 / pp512 of every
# trellis format with the b128 and the full rotation, then per-kernel decode times of qtip2 HYB
# under each rotation.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/b $O/b
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/b/sfx; chmod +x /tmp/b/sfx; S=/tmp/b/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/b/gpu.txt
timeout 150 $S test-backend --device cuda --op trellis --op model_decode --seed 21 > $O/b/conf.md 2>&1
echo "[$(el)s] trellis + model_decode rc=$?: $(grep 'cases on cuda' $O/b/conf.md)"
grep -E '^\| [a-z_]+ \|' $O/b/conf.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head -20
for f in rtn2 qtip2:hyb:b128 qtip2:hyb:full qtip2:1mad:b128 qtip2:1mad:full qtip3:hyb:b128 qtip3:hyb:full qtip4:hyb:b128 qtip4:hyb:full qtip2:hyb:b128; do
  [ $(el) -gt 400 ] && { echo "skip $f: past 400 s"; continue; }
  IFS=: read -r q code rot <<< "$f"
  args=(); [ -n "$code" ] && args=(--trellis-code "$code" --rotation "$rot")
  tag=${f//:/_}
  timeout 60 $S bench --synthetic llama-3.1-8b --device cuda --quant "$q" "${args[@]}" -p 512 -n 128 -r 3 > $O/b/bench_$tag.md 2>&1
  echo "[$(el)s] $f: $(grep -E '^\| llama' $O/b/bench_$tag.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
for rot in b128 full; do
  [ $(el) -gt 440 ] && continue
  SFX_PROFILE_KERNELS=1 timeout 30 $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --rotation $rot -p 0 -n 16 -r 1 --graphs off > $O/b/profile_$rot.md 2> $O/b/profile_$rot.err
  echo "[$(el)s] profile $rot rc=$?"
done
tar czf $O/b.tgz -C $O b && rm -rf $O/b
echo "total $(el) s"
