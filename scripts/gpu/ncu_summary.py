import csv,collections,sys
rows=list(csv.reader(open(sys.argv[1])))
hi=[i for i,r in enumerate(rows) if r and r[0]=='ID'][0]
h=rows[hi]; data=rows[hi+1:]
ki=h.index('Kernel Name'); mi=h.index('Metric Name'); vi=h.index('Metric Value'); idi=h.index('ID')
per=collections.defaultdict(dict); names={}
for r in data:
    per[r[idi]][r[mi]]=r[vi]; names[r[idi]]=r[ki]
agg=collections.defaultdict(lambda: collections.defaultdict(list))
for i,m in per.items():
    n=names[i].split('(')[0]
    for k,v in m.items():
        try: agg[n][k].append(float(v.replace(',','')))
        except: pass
print("| kernel | launches | total µs | mean µs | DRAM % of peak | MB read | occupancy % | IPC | regs | grid |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
tot=0
for n,m in sorted(agg.items(), key=lambda kv: -sum(kv[1]['gpu__time_duration.sum'])):
    d=m['gpu__time_duration.sum']; cnt=len(d); s=sum(d); tot+=s
    avg=lambda k: sum(m.get(k,[0]))/max(len(m.get(k,[0])),1)
    print(f"| {n} | {cnt} | {s/1000:.1f} | {s/cnt/1000:.2f} | {avg('dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} | {avg('dram__bytes_read.sum')/1e6:.2f} | {avg('sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | {avg('sm__inst_executed.avg.per_cycle_elapsed'):.2f} | {avg('launch__registers_per_thread'):.0f} | {avg('launch__grid_size'):.0f} |")
print(f"\n330 decode kernels (graphs off), {tot/1000:.0f} µs")
