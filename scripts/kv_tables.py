#!/usr/bin/env python3
"""Markdown tables for docs/results.md from scripts/kv_results.sh's JSON (issue 5)."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else "results/kv")


def load(name):
    p = out / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None  # not run (yet)


def table(doc, title):
    if doc is None:
        return
    print(f"### {title}\n")
    print(f"`{doc['eval']}`, KL reference: {doc['kl_reference']}, {doc['threads']} threads\n")
    print("| KV | PPL | KL | same top-1 % | decode tok/s | resident MB/1K tok | backing MB/1K tok | refined groups applied | RAM-cache peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        kl = r.get("kl") or {}
        b = r["bytes_per_1k_tokens"]
        st = r["stats"]
        applied = (
            f"{100.0 * st['applied_groups'] / st['selected_groups']:.1f} % of {st['selected_groups'] / max(st['decode_attentions'], 1) / 3:.1f}/head"
            if st["selected_groups"]
            else "–"
        )
        peak = f"{r['cache_peak_bytes'] / 2**20:.2f} MiB" if r.get("tier") else "–"
        tps = f"{r['decode_tokens_per_second']:.1f}" if r["decode_seconds"] > 0 else "(reference)"
        print(
            f"| {r['label']} | {r['ppl']['ppl']:.4f} | {kl.get('mean', float('nan')):.5f} | "
            f"{kl.get('same_top1_pct', float('nan')):.2f} | {tps} | {b['resident'] / 1e6:.3f} | "
            f"{b['backing'] / 1e6:.3f} | {applied} | {peak} |"
        )
    print()


table(load("kv_bases.json"), "Every KVarN base, alone and refined (2-token groups, RAM tier)")
table(load("kv_groups_tiers.json"), "4-token groups; RAM vs SSD spill behind a 2 MiB RAM cache (skip misses)")
table(load("kv_ssd_cache.json"), "SSD tier: RAM-cache size (2/2, 4-token groups, 1/128, skip misses)")
table(load("kv_21_fraction.json"), "2/1 with +0/+1 at higher fractions")
table(load("kv_with_weights.json"), "KV refinement with weight refinement on (rtn3 --fit .sfx, ram tier)")
table(load("kv_with_weights_base.json"), "Same, resident weights only (--no-refine)")
