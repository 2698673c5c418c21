#!/bin/bash
# Issue 14, first slice, call O, right after call N: the CLI end to end on the H200 — SmolLM2
# converted to awq3 --fit here, then sfx-run generating on CUDA with refinement at k = 16 (the
# engine in the backend) and without (--no-refine), greedy, --json.
set -u
cat /tmp/s/gguf.part.aa .gpuB/gguf.part.ab .gpuB/gguf.part.ac | xz -dc > /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf .gpuB/texts.tar.xz -C /tmp/s && mv /tmp/s/assets/* /tmp/s/ 2>/dev/null
SFX_ASSETS=/tmp/s /tmp/x/sfx-convert --quant awq3 --head bf16 --awq-grid 5,5 --fit --calib wiki --calib-seqs 8 \
  --calib-len 256 --heldout none /tmp/s/SmolLM2-135M-Instruct.Q4_1.gguf -o /tmp/a.sfx > /dev/null 2> $OUT/convert.err
echo "convert rc=$?"
for extra in "--k 16" "--no-refine"; do
  tag=$(echo $extra | tr -d ' -')
  timeout 60 /tmp/x/sfx-run /tmp/a.sfx --device cuda -p "The capital of France is" -n 48 --temp 0 $extra --json \
    > $OUT/run_$tag.json 2> $OUT/run_$tag.err; echo "sfx-run $extra rc=$?"
done
python3 -c "
import json,sys
for t in ['k16','norefine']:
    d=json.load(open('$OUT/run_'+t+'.json'))
    print(t, {k: d.get(k) for k in ('text','generated_tokens','decode_tokens_per_s') if k in d}, json.dumps(d.get('refine'))[:600])
" 2>&1 | head -20
