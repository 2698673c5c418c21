#!/bin/bash
# Call G (session 59): which CUDA kernel disagrees with the CPU on seed 21's random Q2_K blocks
# (the whole-model case fails only at that seed): the op-level GGUF and coded cases at seeds 21
# and 22, then the model cases at seed 21 once more.
O=$OUT; t0=$(date +%s); mkdir -p $O/g
xz -dc .gpu/sfx.xz > /tmp/gsfx; chmod +x /tmp/gsfx; S=/tmp/gsfx
for seed in 21 22; do
  timeout 120 $S test-backend --device cuda --op coded_ --op gguf_linear --seed $seed > $O/g/ops_seed$seed.md 2>&1
  echo "[$(( $(date +%s) - t0 ))s] coded + gguf ops seed $seed: $(grep 'cases on cuda' $O/g/ops_seed$seed.md)"
  grep -E 'Q2_K|q2_k' $O/g/ops_seed$seed.md | cut -c1-220 | head -12
done
tar czf $O/g.tgz -C $O g && rm -rf $O/g
echo "total $(( $(date +%s) - t0 )) s"
