#!/bin/bash
# Call F3 (session 59), after cuda2/run_b1.sh p0 and p1 on the same warm machine: the real
# SmolLM2 lnq3 file on CUDA against the CPU (cuda2/run_b3.sh: coded-op conformance, wiki:2 KL of
# CUDA against the CPU on the same codes, six greedy continuations on both devices), then the
# replay of session 58's one conformance failure (model_decode tiny-wide-qwen3 gguf Q2_K at
# seed 21, 4.78e-3 against 3e-3) with the build of 15ab1ff.
O=$OUT; t0=$(date +%s)
bash docs/measurements/issue17/cuda2/run_b3.sh
mkdir -p $O/f3; S=/tmp/b/sfx
[ -x $S ] || { xz -dc .gpu/sfx.xz > /tmp/f3sfx; chmod +x /tmp/f3sfx; S=/tmp/f3sfx; }
for seed in 21 22 23; do
  timeout 60 $S test-backend --device cuda --op model_decode --seed $seed > $O/f3/model_decode_seed$seed.md 2>&1
  echo "[$(( $(date +%s) - t0 ))s] model_decode seed $seed: $(grep 'cases on cuda' $O/f3/model_decode_seed$seed.md)"
  grep -E '^\| [a-z_]+ \|' $O/f3/model_decode_seed$seed.md | grep -v -e '| ok |' -e '^| op |' | cut -c1-300 | head -5
done
tar czf $O/f3.tgz -C $O f3 && rm -rf $O/f3
echo "total $(( $(date +%s) - t0 )) s"
