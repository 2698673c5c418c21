#!/bin/bash
# Call D (session 58): the build with batched_prologue.patch applied (the block-rotation
# prologue issues a batch of its blocks' loads before transforming them), lean: trellis and
# model-decode conformance, then tg128 / pp512 on the 8B shape of the formats it should move
# (qtip3 / qtip4 use 512-thread matvecs: 7 blocks a warp at 14336) beside their full rotation.
O=$OUT; t0=$(date +%s); mkdir -p /tmp/d $O/d
el() { echo $(( $(date +%s) - t0 )); }
xz -dc .gpu/sfx.xz > /tmp/d/sfx; chmod +x /tmp/d/sfx; S=/tmp/d/sfx
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/d/gpu.txt
timeout 120 $S test-backend --device cuda --op trellis --op model_decode --seed 23 > $O/d/conf.md 2>&1
echo "[$(el)s] trellis + model_decode rc=$?: $(grep 'cases on cuda' $O/d/conf.md)"
grep -E '^\| [a-z_]+ \|' $O/d/conf.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-300 | head -20
for f in qtip3:hyb:b128 qtip3:hyb:full qtip4:hyb:b128 qtip4:hyb:full qtip2:hyb:b128 qtip2:hyb:full; do
  [ $(el) -gt 150 ] && { echo "skip $f: past 150 s"; continue; }
  IFS=: read -r q code rot <<< "$f"
  tag=${f//:/_}
  timeout 40 $S bench --synthetic llama-3.1-8b --device cuda --quant "$q" --trellis-code "$code" --rotation "$rot" -p 512 -n 128 -r 3 > $O/d/bench_$tag.md 2>&1
  echo "[$(el)s] $f: $(grep -E '^\| llama' $O/d/bench_$tag.md | awk -F'|' '{print $3 $9 $10 $11}' | tr '\n' ' ')"
done
tar czf $O/d.tgz -C $O d && rm -rf $O/d
echo "total $(el) s"
