#!/bin/bash
# Call B3 (session 57): the last part of the LNQ file, then CUDA against the CPU on the same
# codes, refinement off: wiki:2 KL of the CUDA model against the CPU model (f32 activations on
# the CPU: the reference numerics) and greedy continuations of six prompts on both devices.
O=$OUT; t0=$(date +%s); mkdir -p $O/b3
el() { echo $(( $(date +%s) - t0 )); }
R=$PWD; cd /tmp/b || exit 3
[ -f lnq3.p0 ] && [ -f lnq3.p1 ] || { echo "no parts from calls B1/B2 (a fresh machine)"; exit 3; }
xz -dc $R/.gpu/sfx-run.xz > sfx-run; chmod +x sfx-run
cat lnq3.p0 lnq3.p1 $R/.gpu/lnq3.p2 > lnq3.sfx && sha256sum -c $R/.gpu/lnq3.sha || exit 3
tar xJf $R/.gpu/wiki.txz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/b3/gpu.txt
# The coded kernels against the CPU reference on this card first (the binary of call A).
if [ -f $R/.gpu/sfx.xz ]; then
  xz -dc $R/.gpu/sfx.xz > sfx; chmod +x sfx
  timeout 100 ./sfx test-backend --device cuda --op coded_ --op lut_linear --op gguf_linear --op model_decode --seed 10 > $O/b3/conf.md 2>&1
  echo "[$(el)s] coded ops + models rc=$?: $(grep 'cases on cuda' $O/b3/conf.md)"
fi
export SFX_ASSETS=/tmp/b/assets SFX_CPU_ACTIVATIONS=f32
timeout 300 ./sfx-run lnq3.sfx --ppl wiki:2 --kl-ref lnq3.sfx --kl-ref-device cpu --json > $O/b3/ppl_kl.json 2> $O/b3/ppl_kl.err
echo "[$(el)s] ppl rc=$?"; python3 -c "
import json; d=json.load(open('$O/b3/ppl_kl.json')); b=d['base']
print('base ppl', b['ppl'], 'KL(CPU||CUDA)', b['kl'])"
i=0
for p in "The capital of France is" "def fibonacci(n):" "Once upon a time, in a small village," "The three primary colors are" "Water boils at" "In 1969, astronauts"; do
  for dev in auto cpu; do
    timeout 60 ./sfx-run lnq3.sfx -p "$p" -n 48 --temp 0 --k 0 --device $dev > $O/b3/gen_${i}_$dev.txt 2> $O/b3/gen_${i}_$dev.err
  done
  cmp -s $O/b3/gen_${i}_auto.txt $O/b3/gen_${i}_cpu.txt && echo "prompt $i: identical" || echo "prompt $i: DIFFERENT"
  i=$((i+1))
done
grep -h "loaded" $O/b3/gen_0_*.err
tar czf $O/b3.tgz -C $O b3 && rm -rf $O/b3
echo "total $(el) s"
