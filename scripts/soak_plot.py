#!/usr/bin/env python3
"""Plots `sfx-run --soak … --soak-log FILE.csv` logs: resident memory and decode speed against
tokens generated, one line per log, in two PNGs (needs matplotlib: `pip install matplotlib`),
and device memory in a third when a log has it (a GPU soak).

    python3 scripts/soak_plot.py --out docs/soak LABEL=run.csv [LABEL=run.csv …]

Writes OUT/soak_rss.png, OUT/soak_speed.png (and OUT/soak_device.png), and prints per log:
tokens, generations, the largest RSS of the second generation and of the later ones, the growth
at like positions (the verdict of `sfx-run --soak`; for device memory too), and the mean decode
speed of the first and the last complete generation.
"""
import argparse
import csv
import os
import sys


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{path}: no samples")
    for r in rows:
        for k in ("tokens", "generation", "position"):
            r[k] = int(r[k])
        r["tokens_per_second"] = float(r["tokens_per_second"])
        r["rss_bytes"] = int(r["rss_bytes"])
        device = r.get("device_bytes") or ""
        r["device_bytes"] = int(device) if device else None
    return rows


def growth_at_like_positions(rows, key):
    ref = {r["position"]: r[key] for r in rows if r["generation"] == 1 and r[key] is not None}
    later = [r for r in rows if r["generation"] >= 2 and r[key] is not None]
    g = [r[key] - ref[r["position"]] for r in later if r["position"] in ref]
    return max(max(g), 0) if g else None


def summary(rows):
    """As sfx-run's verdict: RSS of generations ≥ 2 against generation 1 at like positions."""
    gens = max(r["generation"] for r in rows) + 1
    ref = {r["position"]: r["rss_bytes"] for r in rows if r["generation"] == 1}
    later = [r for r in rows if r["generation"] >= 2]
    growth = growth_at_like_positions(rows, "rss_bytes") or 0
    device = growth_at_like_positions(rows, "device_bytes")
    full = max(r["position"] for r in rows if r["generation"] == 0)
    complete = [g for g in range(gens) if max((r["position"] for r in rows if r["generation"] == g), default=0) == full]
    def speed(g):
        v = [r["tokens_per_second"] for r in rows if r["generation"] == g]
        return sum(v) / len(v)
    mib = 1 << 20
    return (rows[-1]["tokens"], gens, max(ref.values(), default=0) / mib,
            max((r["rss_bytes"] for r in later), default=0) / mib, growth / mib,
            None if device is None else device / mib, speed(0), speed(complete[-1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the PNGs")
    ap.add_argument("logs", nargs="+", metavar="LABEL=CSV")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("matplotlib is needed: pip install matplotlib")
    logs = []
    for spec in a.logs:
        label, sep, path = spec.partition("=")
        if not sep:
            sys.exit(f"{spec!r}: expected LABEL=CSV")
        logs.append((label, read(path)))
    os.makedirs(a.out, exist_ok=True)
    print("| run | tokens | generations | RSS max, gen. 2 (MiB) | RSS max, gen. ≥ 3 (MiB) | growth at like positions (MiB) | device memory growth (MiB) | tok/s gen. 1 | tok/s last |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in logs:
        t, g, ref, mx, growth, device, s0, s1 = summary(rows)
        dev = "—" if device is None else f"{device:.2f}"
        print(f"| {label} | {t} | {g} | {ref:.1f} | {mx:.1f} | {growth:.2f} | {dev} | {s0:.1f} | {s1:.1f} |")
    plots = [
        ("rss_bytes", "resident memory (MiB)", "soak_rss.png", 1 / (1 << 20)),
        ("tokens_per_second", "decode tok/s (interval mean)", "soak_speed.png", 1.0),
    ]
    if any(r["device_bytes"] is not None for _, rows in logs for r in rows):
        plots.append(("device_bytes", "device memory in use (MiB)", "soak_device.png", 1 / (1 << 20)))
    for key, ylabel, name, scale in plots:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for label, rows in logs:
            pts = [(r["tokens"], r[key] * scale) for r in rows if r[key] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, linewidth=1)
        ax.set_xlabel("tokens generated (one process; a new generation every -n tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(a.out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
