#!/usr/bin/env python3
"""Splits an `ncu --page source --csv --print-source sass` export of tr_matvec launches into
regions by SASS position: before the first HMMA (table fill, prologue, staging), between the
first and last HMMA (the decode loop), after it (reduction, stores). Prints warp-state samples
per region and per launch, and the 15 instructions with most samples outside the loop.

    python3 regions.py src.csv.gz
"""
import csv
import gzip
import sys


def launches(path):
    opener = gzip.open if path.endswith(".gz") else open
    out, cur, hdr = [], None, None
    with opener(path, "rt", newline="") as f:
        for line in csv.reader(f):
            if not line:
                continue
            if line[0] == "Kernel Name":
                cur = []
                out.append((line[1], cur))
            elif line[0] == "Address":
                hdr = {h: i for i, h in enumerate(line)}
            elif cur is not None:
                cur.append(line)
    return out, hdr


def main():
    rows, hdr = launches(sys.argv[1])
    col = hdr["Warp Stall Sampling (All Samples)"]
    for n, (name, rs) in enumerate(rows):
        samples = [int(r[col] or 0) for r in rs]
        src = [r[1].strip() for r in rs]
        mma = [i for i, s in enumerate(src) if s.startswith("HMMA")]
        if not mma:
            print(f"launch {n} {name}: no HMMA")
            continue
        lo, hi = mma[0], mma[-1]
        total = sum(samples) or 1
        pre, loop, post = sum(samples[:lo]), sum(samples[lo:hi + 1]), sum(samples[hi + 1:])
        print(f"launch {n} {name}: {total} samples; before the loop {pre / total:.0%}, "
              f"loop {loop / total:.0%}, after {post / total:.0%}")
        outside = sorted(((samples[i], i, src[i]) for i in range(len(src)) if not lo <= i <= hi),
                         reverse=True)[:15]
        for s, i, text in outside:
            print(f"    {s:6d}  #{i:5d}  {text}")


if __name__ == "__main__":
    main()
