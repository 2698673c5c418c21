#!/bin/bash
B=$PWD/.gpu/bin; O=$OUT
cp $B/sfx /tmp/sfx; S=/tmp/sfx
M="--synthetic llama-3.1-8b --device cuda"
t0=$(date +%s)
timeout 200 ncu --clock-control none --cache-control none --kernel-name regex:tr_matvec --launch-skip 40 --launch-count 4 \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed.sum' \
  --section ComputeWorkloadAnalysis \
  $S bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off > $O/ncu_stalls.txt 2>&1
echo "stalls $(( $(date +%s) - t0 )) s"
timeout 200 ncu --clock-control none --cache-control none --launch-skip 200 --launch-count 400 \
  --metrics gpu__time_duration.sum --csv $S bench $M --quant qtip2 -p 0 -n 4 -r 1 --graphs off > $O/ncu_step.csv 2> $O/ncu_step.err
echo "step $(( $(date +%s) - t0 )) s"
python3 - $O/ncu_step.csv <<'PY'
import csv,sys,collections
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ki=h.index('Kernel Name'); vi=h.index('Metric Value'); gi=h.index('Grid Size') if 'Grid Size' in h else None
d=collections.defaultdict(list)
for r in rows[1:]:
    try: d[(r[ki].split('(')[0], r[gi] if gi else '')].append(float(r[vi].replace(',','')))
    except: pass
tot=sum(sum(v) for v in d.values())
for k,v in sorted(d.items(), key=lambda kv:-sum(kv[1])):
    print(f"{k[0]:40s} {k[1]:14s} n={len(v):4d} mean={sum(v)/len(v)/1000:8.2f} us  share={sum(v)/tot*100:5.1f}%")
PY
