#!/usr/bin/env bash
# Call D: the same file tuned with its candidates timed on a synthetic Llama-3.1-8B in the
# file's formats (awq3 g128 codes, q8 head, random refinement columns of the 8B's sizes in
# pinned host memory); KL still SmolLM2's. Then every distinct choice, and the untuned
# k = 16, on wiki:8 (KL to the float GGUF) on the GPU.
set -euo pipefail
cd /tmp/w
D=/tmp/w/d; mkdir -p $D
trap 'tar czf $OUT/d.tgz -C /tmp/w d' EXIT
G=assets/SmolLM2-135M-Instruct.Q4_1.gguf
export SFX_ASSETS=/tmp/w/assets
./sfx tune awq3-ladder.sfx --kl-ref $G --device cuda --speed-model llama-3.1-8b --json \
    > $D/tune_8b.json 2> tune_8b.err || { tail -40 tune_8b.err; exit 1; }
cp tune_8b.err $D/
./sfx inspect awq3-ladder.sfx > $D/inspect.txt
cp awq3-ladder.sfx.tune.json $D/tune_after_8b.json
python3 - "$D/tune_8b.json" > settings.txt <<'PY'
import json, sys
seen = set()
for p in json.load(open(sys.argv[1]))["result"]["profiles"]:
    if p["k"] == [0, 0, 0, 0]:
        continue
    key = (",".join(map(str, p["k"])), ",".join(str(s) for s in p["s"]))
    if key not in seen:
        seen.add(key)
        print(key[0], key[1])
PY
cat settings.txt | tee $D/settings.txt
while read -r k s; do
  echo "== k $k s $s"
  ./sfx-run awq3-ladder.sfx --device cuda --ppl wiki:8 --kl-ref $G --no-tune --k "$k" --s "$s" \
      --json --no-base > "$D/wiki8_k${k//,/-}_s${s//,/-}.json" 2>> wiki.err || tail -5 wiki.err
done < settings.txt
./sfx-run awq3-ladder.sfx --device cuda --ppl wiki:8 --kl-ref $G --no-tune --k 16 --json \
    > $D/wiki8_k16_untuned.json 2>> wiki.err || tail -5 wiki.err
cp wiki.err $D/
