#!/bin/bash
# Call B2 (session 61), issue 20 on the device host: determinism of the converter on a 16-core
# machine, the soak on the GPU (device memory judged beside RSS), and same-seed sampling on
# the GPU. Carries .gpu/gguf.sha, .gpu/texts.txz (brown/, wiki/), .gpu/sfx-convert.xz and
# .gpu/sfx-run.xz; the GGUF's three parts are in /tmp/b (stashed by calls B1).
#  1. `sfx-convert --quant rtn3 --fit` (calibration 8 × 512, receipt wiki:1 at 512) with 16
#     threads and, concurrently, with 2 threads, each in its own folder with the same relative
#     output path (what scripts/determinism.sh does, one thread count after another); every
#     file of the two output folders compared by SHA-256.
#  2. The soak on the GPU with the 16-thread model: 20,000 tokens as generations of 2,000 per
#     KV configuration, the weight refinement on the ram tier (selection inside the step
#     graph); one run with both refinements on the ssd tiers (host-driven).
#  3. The same seed sampled twice on the GPU (f16 KV and KVarN 2/2): identical text expected.
# Session 61 ran it whole on an H100: the 16-thread conversion took 60 s, the 2/2 soak 146 s;
# the f16 and 3/2 soaks were cut by their 150 s timeouts and the 2-thread conversion by the
# call's. Hence two phases (one call each, the machine kept warm between them):
#   run_b2.sh convert   assemble, both conversions, the f16 and 2/2 soaks, same-seed sampling
#   run_b2.sh soak      the 3/2 (vram) and ssd-tier soaks on the converted model
PHASE=${1:-convert}
O=$OUT; t0=$(date +%s); mkdir -p $O/b
el() { echo $(( $(date +%s) - t0 )); }
R=$PWD; cd /tmp/b || exit 3
if [ "$PHASE" = convert ]; then
[ -f gguf.p0 ] && [ -f gguf.p1 ] && [ -f gguf.p2 ] || { echo "GGUF parts missing in /tmp/b (a fresh machine?)"; exit 3; }
cat gguf.p0 gguf.p1 gguf.p2 > SmolLM2-135M-Instruct.Q4_1.gguf && (sha256sum -c $R/.gpu/gguf.sha) || exit 3
rm -f gguf.p0 gguf.p1 gguf.p2
tar xJf $R/.gpu/texts.txz
for b in sfx-convert sfx-run; do xz -dc $R/.gpu/$b.xz > $b; chmod +x $b; done
export SFX_ASSETS=/tmp/b
G=/tmp/b/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/b/gpu.txt
echo "$(nproc) cores; $(./sfx-convert --version)" | tee -a $O/b/gpu.txt
convert() { # threads
  rm -rf det/t$1; mkdir -p det/t$1
  local s=$(date +%s)
  (cd det/t$1 && RAYON_NUM_THREADS=$1 timeout 560 /tmp/b/sfx-convert --quant rtn3 --fit --calib-seqs 8 \
     --quality wiki:1 --quality-ctx 512 $G -o out --json > report.json 2> log.txt)
  echo "rc=$? seconds=$(( $(date +%s) - s ))" > det/t$1/rc.txt
}
convert 2 & c2=$!
convert 16
echo "[$(el)s] 16 threads: $(cat det/t16/rc.txt)"; tail -n 3 det/t16/log.txt
fi
M=/tmp/b/det/t16/out
soak() { # tag tokens timeout args...
  local tag=$1 n=$2 to=$3; shift 3
  timeout $to ./sfx-run $M --device cuda -p "The history of the city begins" -n 2000 --soak $n \
    --soak-every 250 --json --soak-log $O/b/soak_$tag.csv "$@" > $O/b/soak_$tag.json 2> $O/b/soak_$tag.log
  echo "[$(el)s] soak $tag rc=$?: $(python3 -c "
import json; d=json.load(open('$O/b/soak_$tag.json')); s=d['summary']; m=1<<20
print(d['kv_cache'], '| rss ref %.1f max %.1f growth %.2f MiB | device ref %.1f max %.1f growth %.2f MiB | tok/s %.0f -> %.0f | failures %s' % (
 s['rss_reference_bytes']/m, s['rss_max_bytes']/m, s['rss_growth_bytes']/m,
 (s['device_reference_bytes'] or 0)/m, (s['device_max_bytes'] or 0)/m, (s['device_growth_bytes'] or 0)/m,
 s['first_generation_tokens_per_second'], s['last_generation_tokens_per_second'], s['failures']))" 2>&1 | tail -n 1)"
}
if [ "$PHASE" = soak ]; then
  soak 3_2_vram 20000 250 --kv 3/2 --kv-tier vram
  soak 2_1_ssd 10000 250 --kv 2/1 --kv-tier ssd --kv-cache 256KiB --refine-tier ssd --weight-cache 8MiB
  tar czf $O/b_soak.tgz -C $O b && rm -rf $O/b
  echo "total $(el) s"; exit 0
fi
if [ -f $M/model.sfx ]; then
  soak f16 20000 250 --kv f16
  soak 2_2 20000 250 --kv 2/2
  for kv in f16 2/2; do
    for i in 1 2; do
      timeout 60 ./sfx-run $M --device cuda --kv $kv -p "The history of the city of York" -n 400 \
        --ignore-eos --temp 0.9 --seed 7 > $O/b/same_seed_${kv/\//_}_$i.txt 2> $O/b/same_seed_${kv/\//_}_$i.log
    done
    cmp -s $O/b/same_seed_${kv/\//_}_1.txt $O/b/same_seed_${kv/\//_}_2.txt && r=identical || r=DIFFERENT
    echo "[$(el)s] same seed on the GPU, $kv KV, two processes: $r ($(wc -c < $O/b/same_seed_${kv/\//_}_1.txt) bytes)"
  done
fi
wait $c2
echo "[$(el)s] 2 threads: $(cat det/t2/rc.txt)"
same=yes
for f in $(cd det/t16/out && find . -type f | sort); do
  a=$(sha256sum < det/t16/out/$f | cut -c1-16); b=$(sha256sum < det/t2/out/$f 2>/dev/null | cut -c1-16)
  [ "$a" = "$b" ] && s=yes || { s=NO; same=no; }
  echo "| ${f#./} | $a | $b | $s |"
done | tee $O/b/determinism.md
[ "$(cd det/t16/out && find . -type f | wc -l)" = "$(cd det/t2/out && find . -type f | wc -l)" ] || echo "file sets differ" | tee -a $O/b/determinism.md
cp det/t16/log.txt $O/b/convert_t16.log; cp det/t2/log.txt $O/b/convert_t2.log; cp det/t16/rc.txt $O/b/rc_t16.txt; cp det/t2/rc.txt $O/b/rc_t2.txt
cp det/t16/report.json $O/b/convert_t16.json
tar czf $O/b.tgz -C $O b && rm -rf $O/b
echo "total $(el) s"
