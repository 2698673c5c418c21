#!/bin/bash
# LNQ settings screen (session 57): base KL on wiki:8 of an lnq3 conversion made with the
# settings in ENV (SFX_LNQ_PLAIN = the unweighted part's weight a, SFX_LNQ_DAMP = the damping d:
# overrides read by `Lnq::new`, recorded in the file's params.lnq) and the guided objective it reached
# against SqueezeLLM's start, summed per set over the layers.
# usage: screen.sh TAG ENV...
cd "$(dirname "$0")/../../../.."
tag=$1; shift
O=${OUT:-/tmp/lnqscreen}; mkdir -p $O
env "$@" target/release/sfx-convert --quant lnq3 assets/SmolLM2-135M-Instruct.Q4_1.gguf -o $O/$tag.sfx \
  --calib-seqs 16 --calib-len 512 --yaqa-seqs 8 --json > $O/$tag.convert.json 2> $O/$tag.convert.log
target/release/sfx-run $O/$tag.sfx --k 0 --ppl wiki:8 --kl-ref assets/SmolLM2-135M-Instruct.Q4_1.gguf --json > $O/$tag.k0.json 2>/dev/null
python3 -c "
import json,sys
d=json.load(open('$O/$tag.k0.json')); c=json.load(open('$O/$tag.convert.json'))
qi=[l['quant_info'] for l in c['layers']]
r={s: sum(q[s]['objective_lnq'] for q in qi)/sum(q[s]['objective_sqllm'] for q in qi) for s in qi[0]}
print('$tag', 'KL', round(d['kl']['mean'],4), 'ppl', round(d['ppl'],2), 'obj ratio', {k: round(v,3) for k,v in r.items()})
"
rm -f $O/$tag.sfx
