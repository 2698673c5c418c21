#!/bin/bash
# (second build: one wave where at most two blocks fit an SM) Double-buffered partial rows (one barrier a tile set), 16-warp blocks where an 8-warp block
# fills an SM (SFX_GT_WIDE), and the one-wave rule on every tile launch (SFX_GT_ONE_WAVE=1):
# group conformance with forced multi-set and wide plans, then tg128 A/B against the landed build.
O=$OUT; M="--synthetic llama-3.1-8b --device cuda"; t0=$(date +%s)
for b in ow final; do mkdir -p /tmp/$b; xz -dc .gpu/xz/$b.xz > /tmp/$b/sfx; chmod +x /tmp/$b/sfx; done; S=/tmp/ow/sfx
for plan in default 1,3,3 1,3,2,16 2,3,2; do
  if [ $plan = default ]; then E="X=1"; else E="SFX_GT_PLAN=$plan"; fi
  f=$O/test_backend_${plan//,/_}.md
  for op in group model_decode; do timeout 120 env $E $S test-backend --device cuda --op $op; done > $f 2>&1
  echo "plan $plan: $(grep 'cases on cuda' $f | tr '\n' ' ')"; grep -E "\| FAIL" $f | head -3
done
echo "conformance $(( $(date +%s) - t0 )) s"
tg() { timeout 40 env $1 $2 bench $M --quant $3 -p 0 -n 128 -r 3 2>&1 | grep tg128 | awk -F'|' '{print $9}' | awk '{print $1}' | tr '\n' ' '; }
for q in rtn4 rtn2 rtn4 rtn2; do echo "$q tg128 new $(tg X=1 $S $q) one_wave $(tg SFX_GT_ONE_WAVE=1 $S $q) old $(tg X=1 /tmp/final/sfx $q)"; done | tee $O/ab_one_wave.md
echo "total $(( $(date +%s) - t0 )) s"
# Choose the configuration for the side-by-side call (run21 reads /tmp/chosen_env): the largest
# sum over rtn4 and rtn2 of mean tg128 relative to the landed build.
python3 - "$O/ab_one_wave.md" > /tmp/chosen_env <<'PY'
import sys, collections
vals = collections.defaultdict(list)
for line in open(sys.argv[1]):
    w = line.split(); q = w[0]; key = None
    for tok in w[2:]:
        try: vals[(q, key)].append(float(tok))
        except ValueError: key = tok
mean = {k: sum(v)/len(v) for k, v in vals.items() if v}
envs = {"new": "X=1", "one_wave": "SFX_GT_ONE_WAVE=1"}
score = {c: sum(mean[(q, c)] / mean[(q, "old")] for q in ("rtn4", "rtn2")) for c in envs}
best = max(score, key=score.get)
print(envs[best])
print(" ".join(f"{c}={s:.4f}" for c, s in score.items()), file=sys.stderr)
PY
echo "chosen: $(cat /tmp/chosen_env)" | tee $O/chosen.txt
