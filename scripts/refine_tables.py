#!/usr/bin/env python3
"""Markdown tables for docs/results.md from the `sfx-run --json` reports written by the
refinement measurement runs (see docs/results.md for the commands). Usage:
    scripts/refine_tables.py <dir with the JSON reports>
Reads only what sfx-run measured; prints nothing it did not find."""
import json, os, sys

d = sys.argv[1]
# Bytes of the channel-wise refinement of the model (for the random-access hit-rate
# expectation: a cache holding a fraction f of uniformly accessed units hits with rate f).
total = float(sys.argv[2]) if len(sys.argv) > 2 else None

def load(name):
    p = os.path.join(d, name + ".json")
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

def kl(r):
    return r["kl"]["mean"] if r and r.get("kl") else float("nan")

print("| base | variant | k | PPL | KL | fetched KB/token |")
print("|---|---|---|---|---|---|")
for q in ["rtn2", "rtn3", "awq3"]:
    main = load(f"{q}-fit-k16")
    if main and "base" in main:
        b = main["base"]
        print(f"| {q} | resident base | 0 | {b['ppl']:.3f} | {b['kl']['mean']:.4f} | 0 |")
    rows = []
    for k in [8, 16, 32, 64]:
        rows.append(("plain", k, load(f"{q}-plain-k{k}")))
    for k in [8, 16, 32, 64]:
        rows.append(("fitted", k, main if k == 16 else load(f"{q}-fit-k{k}")))
    rows.append(("plain + bundles", 16, load(f"{q}-plain-bundles")))
    rows.append(("fitted + bundles", 16, load(f"{q}-fit-bundles")))
    for s in ["0.5", "1"]:
        rows.append((f"fitted + lead/lag s={s}", 16, load(f"{q}-fit-s{s}")))
    for name, k, r in rows:
        if r is None:
            continue
        fb = r["refine"]["fetched_bytes_per_token"] / 1024 if r.get("refine") else 0
        print(f"| {q} | {name} | {k} | {r['ppl']:.3f} | {kl(r):.4f} | {fb:.0f} |")

print()
print("| ssd cache | miss | KL | applied | hit rate | fetched KB/token | backing reads MB/token |")
print("|---|---|---|---|---|---|---|")
for c in [1, 4, 16, 64]:
    for m in ["skip", "wait"]:
        r = load(f"ssd-c{c}-{m}")
        if r is None:
            continue
        rf = r["refine"]
        tok = max(rf["counters"]["tokens"], 1)
        read = rf["store"]["bytes_read_from_backing"] / tok / 2**20
        print(f"| {c} MiB | {m} | {kl(r):.4f} | {100*rf['applied_fraction']:.1f} % | "
              f"{rf['cache_hit_rate']:.3f} | {rf['fetched_bytes_per_token']/1024:.0f} | {read:.3f} |")

print()
print("| cache | hit rate (wait) | random-access expectation |")
print("|---|---|---|")
for c in ["1", "4", "16", "64"]:
    r = load(f"ssd-c{c}-wait")
    if r is None:
        continue
    rf = r["refine"]
    exp = f"{min(1.0, float(c) * 2**20 / total):.3f}" if total else "–"
    print(f"| {c} MiB | {rf['cache_hit_rate']:.3f} | {exp} |")

print()
for q in ["rtn2", "rtn3", "awq3"]:
    r = load(f"{q}-fit-k16")
    if r and "base" in r:
        print(f"{q}: base {r['base']['scored_tokens_per_second']:.1f} tok/s, refined "
              f"{r['scored_tokens_per_second']:.1f} tok/s (refined/base time "
              f"{r['refined_over_base_time']:.3f})")

print()
for s_ in ["0", "1"]:
    r = load(f"lead-s{s_}")
    if r:
        rf = r["refine"]
        print(f"ssd 4 MiB skip, lead s={s_} (qkv, gu): KL {kl(r):.4f}, applied {100*rf['applied_fraction']:.1f} %, PPL {r['ppl']:.3f}")
