#!/usr/bin/env bash
# Call D: the same file tuned on this host's CPU (16 threads), then each CUDA choice and the
# untuned k = 16 on wiki:8 (KL to the float GGUF) on the GPU.
set -euo pipefail
cd /tmp/w
G=assets/SmolLM2-135M-Instruct.Q4_1.gguf
export SFX_ASSETS=/tmp/w/assets
./sfx tune awq3-ladder.sfx --kl-ref $G --device cpu > $OUT/tune_cpu.md 2> tune_cpu.err \
    || { tail -40 tune_cpu.err; exit 1; }
cat $OUT/tune_cpu.md
cp tune_cpu.err $OUT/
cp awq3-ladder.sfx.tune.json $OUT/tune_after_cpu.json
for b in 2.5% 5% 10% 20%; do
  echo "== budget $b (cuda profile)"
  ./sfx-run awq3-ladder.sfx --device cuda --ppl wiki:8 --kl-ref $G --budget $b --json --no-base \
      > "$OUT/wiki8_cuda_${b%\%}.json" 2>> wiki.err || tail -5 wiki.err
done
./sfx-run awq3-ladder.sfx --device cuda --ppl wiki:8 --kl-ref $G --no-tune --k 16 --json \
    > $OUT/wiki8_cuda_k16_untuned.json 2>> wiki.err || tail -5 wiki.err
cp wiki.err $OUT/
