#!/bin/bash
# Prepared in session 61 (no device time left to run it): where the qtip2 HYB b128 matvec's
# fixed cost goes. Fitting the 2026-12-06 ncu durations against tile counts gives each of the
# four matvecs of a layer ~7–10 µs that does not scale with its tiles (q/k/v 13.9 µs for 98 k
# tiles, gate/up 27.8 µs for 459 k), ~1 ms of a 2.7 ms token. The run7 source profile (an
# older build, full rotation) put 78 % of the o launch's warp samples and 43 % of gate/up's
# outside the decode loop: table fill, prologue, reduction. This call samples the current
# build per SASS instruction for all four launches of one layer, so the next change is chosen
# from where the samples are, not guessed.
# Needs .gpu/sfx.xz built with SFX_NVCC_LINEINFO=1 SFX_CUDA_ARCHS=90 (lineinfo maps SASS to
# source lines). Analysis here: python3 docs/measurements/issue13/run20/regions.py src.csv.gz
O=$OUT; t0=$(date +%s); mkdir -p /tmp/n $O/n
xz -dc .gpu/sfx.xz > /tmp/n/sfx; chmod +x /tmp/n/sfx; S=/tmp/n/sfx
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/n/gpu.txt
ncu --version | tail -1 | tee -a $O/n/gpu.txt
# Layer 2's four matvecs (q/k/v, o, gate/up, down): skip the first layer's (warm-up).
timeout 300 ncu --clock-control none --cache-control none --kernel-name regex:tr_matvec \
  --launch-skip 4 --launch-count 4 \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy \
  --section SpeedOfLight --import-source yes -o /tmp/n/rep \
  $S bench --synthetic llama-3.1-8b --device cuda --quant qtip2 --trellis-code hyb \
  --rotation b128 -p 0 -n 2 -r 1 --graphs off > $O/n/ncu_run.txt 2>&1
echo "[$(( $(date +%s) - t0 ))s] ncu rc=$?"
ncu -i /tmp/n/rep.ncu-rep --page source --csv --print-source sass > /tmp/n/src.csv 2> $O/n/src_err.txt
gzip -c /tmp/n/src.csv > $O/n/src.csv.gz
ncu -i /tmp/n/rep.ncu-rep --page details > $O/n/details.txt 2>&1
grep -E "tr_matvec|Duration|Warp Cycles Per Issued|Executed Ipc|Registers|Dynamic Shared" $O/n/details.txt
tar czf $O/n.tgz -C $O n && rm -rf $O/n
echo "total $(( $(date +%s) - t0 )) s"
