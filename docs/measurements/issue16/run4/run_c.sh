#!/usr/bin/env bash
# Call C: the second half; convert the awq3 k ladder on the host's 16 cores (the same command
# as run3, so the same file: its SHA-256 is checked against run3's), then tune it on the GPU
# with the k = 0 fix (281a99b): speed of the file itself, KL on held-out Persuasion.
set -euo pipefail
cd /tmp/w
G=assets/SmolLM2-135M-Instruct.Q4_1.gguf
cat part0 "$OLDPWD/.gpu3/ggufpart.01" > $G
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c | tee $OUT/c.txt
export SFX_ASSETS=/tmp/w/assets
/usr/bin/time -v ./sfx-convert --quant awq3 --fit --k-ladder 4,8,16,32 --mlp channels $G \
    -o awq3-ladder.sfx --json > $OUT/convert.json 2> convert.err || { tail -30 convert.err; exit 1; }
grep -E "Elapsed|Maximum resident|User time|System time" convert.err | tee -a $OUT/c.txt
sha256sum awq3-ladder.sfx | tee -a $OUT/c.txt
./sfx tune awq3-ladder.sfx --kl-ref $G --device cuda > $OUT/tune_cuda.md 2> tune_cuda.err \
    || { tail -40 tune_cuda.err; exit 1; }
cat $OUT/tune_cuda.md
cp tune_cuda.err $OUT/
cp awq3-ladder.sfx.tune.json $OUT/tune_after_cuda.json
