#!/bin/bash
# Call B3: SmolLM2-135M rtn3.sfx (sfx-convert --quant rtn3, default q8 head; carried in three
# parts) on CUDA vs CPU, refinement off: wiki:2 KL of the CUDA base against the CPU base (f32
# activations: the reference numerics) and greedy continuations on both.
O=$OUT; t0=$(date +%s); mkdir -p $O/b3; cd /tmp/b
el() { echo $(( $(date +%s) - t0 )); }
R=$OLDPWD
cat rtn3.p1 rtn3.p2 $R/.gpu3/rtn3.p3 > rtn3.sfx && sha256sum -c <(sed "s|/tmp/sm/rtn3.sfx|rtn3.sfx|" $R/.gpu3/rtn3.sha) || exit 3
xz -dc $R/.gpu3/sfx-run.xz > sfx-run; chmod +x sfx-run; tar xJf $R/.gpu3/wiki.txz
export SFX_ASSETS=/tmp/b/assets SFX_CPU_ACTIVATIONS=f32
timeout 300 ./sfx-run rtn3.sfx --ppl wiki:2 --kl-ref rtn3.sfx --kl-ref-device cpu --json > $O/b3/ppl_kl.json 2> $O/b3/ppl_kl.err
echo "[$(el)s] ppl rc=$?"; python3 -c "
import json; d=json.load(open('$O/b3/ppl_kl.json')); b=d['base']
print('device', d.get('device'), 'base ppl', b['ppl'], 'base KL', b['kl'])"
i=0
for p in "The capital of France is" "def fibonacci(n):" "Once upon a time, in a small village," "The three primary colors are" "Water boils at" "In 1969, astronauts"; do
  for dev in auto cpu; do
    timeout 60 ./sfx-run rtn3.sfx -p "$p" -n 48 --temp 0 --k 0 --device $dev > $O/b3/gen_${i}_$dev.txt 2> $O/b3/gen_${i}_$dev.err
  done
  cmp -s $O/b3/gen_${i}_auto.txt $O/b3/gen_${i}_cpu.txt && echo "prompt $i: identical" || echo "prompt $i: DIFFERENT"
  i=$((i+1))
done
grep -h "loaded" $O/b3/gen_0_*.err
tar czf $O/b3.tgz -C $O b3 && rm -rf $O/b3
echo "total $(el) s"
