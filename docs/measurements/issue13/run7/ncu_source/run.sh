#!/bin/bash
# Where the trellis matvec's cycles go: ncu warp-state sampling per SASS instruction of the
# o-projection (one pair per warp) and gate/up (seven) launches of a qtip2 decode step.
B=$PWD/.gpu/bin; O=$OUT
mkdir -p /tmp/bin; cp $B/sfx /tmp/bin/sfx; S=/tmp/bin/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
ncu --version | tail -1
timeout 240 ncu --clock-control none --cache-control none --kernel-name regex:tr_matvec --launch-skip 41 --launch-count 2 \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy --import-source no \
  -o /tmp/rep $S bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off > $O/ncu_run.txt 2>&1
echo "ncu $(( $(date +%s) - t0 )) s"; ls -la /tmp/rep*
ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > /tmp/src.csv 2> $O/src_err.txt
wc -l /tmp/src.csv; head -3 /tmp/src.csv | cut -c1-600
gzip -c /tmp/src.csv > $O/src.csv.gz
ncu -i /tmp/rep.ncu-rep --page details > $O/details.txt 2>&1
cp /tmp/rep.ncu-rep $O/ 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
