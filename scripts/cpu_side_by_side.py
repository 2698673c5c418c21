#!/usr/bin/env python3
"""Decode and prefill speed of our files and llama.cpp's on this CPU, side by side.

Each round runs every pairing once, alternating ours and theirs (`llama-bench -p P -n N -r 1
-t T` and `sfx bench -p P -n N -r 1 --device cpu`), so both see the same machine state; the
table reports the mean ± sd over rounds and the ratio of means, with the bytes each side
reads per decoded token (ours: `sfx bench`'s own count; llama.cpp: its model size, which for
a tied embedding is what a token reads).

    scripts/cpu_side_by_side.py --llama-bench PATH/llama-bench --sfx target/release/sfx \
        --pair "rtn4 + q8 head=ours.sfx:Q4_0=theirs.gguf" [--pair ...] [--rounds 3] \
        [--pair "qtip2=synthetic/smollm2-135m/qtip2:Q2_K=theirs.gguf"] \
        [-p 512] [-n 128] [-t 2] [--out table.md]
"""

import argparse
import json
import statistics
import subprocess
import sys


def run_json(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def theirs(args, gguf):
    rows = run_json([args.llama_bench, "-m", gguf, "-p", str(args.p), "-n", str(args.n),
                     "-r", "1", "-t", str(args.t), "-o", "json"])
    res = {"bytes": rows[0]["model_size"]}
    for r in rows:
        key = "pp" if r["n_prompt"] > 0 else "tg"
        res[key] = r["avg_ts"]
    return res


def ours(args, model):
    # "synthetic/SHAPE/QUANT" is `sfx bench --synthetic SHAPE --quant QUANT` (random valid
    # codes: the speed of a format without converting a model to it).
    if model.startswith("synthetic/"):
        _, shape, quant = model.split("/", 2)
        source = ["--synthetic", shape, "--quant", quant]
    else:
        source = ["-m", model]
    rows = run_json([args.sfx, "bench", *source, "-p", str(args.p), "-n", str(args.n),
                     "-r", "1", "--device", "cpu", "--json"])
    res = {}
    for r in rows:
        key = "pp" if r["test"].startswith("pp") else "tg"
        res[key] = r["mean"]
        if key == "tg":
            res["bytes"] = r["bytes_per_token"]
    return res


def fmt(xs):
    if len(xs) > 1:
        return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"
    return f"{xs[0]:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--sfx", default="target/release/sfx")
    ap.add_argument("--pair", action="append", required=True,
                    help="'our label=ours.sfx:their label=theirs.gguf'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    pairs = []
    for spec in args.pair:
        try:
            a, b = spec.split(":", 1)
            ol, of = a.rsplit("=", 1)
            tl, tf = b.rsplit("=", 1)
        except ValueError:
            sys.exit(f"--pair {spec!r}: expected 'our label=ours.sfx:their label=theirs.gguf'")
        pairs.append((ol, of, tl, tf))
    results = {i: {"ours": [], "theirs": []} for i in range(len(pairs))}
    for rnd in range(args.rounds):
        for i, (ol, of, tl, tf) in enumerate(pairs):
            # Alternate which side goes first so neither always runs on a warmer machine.
            order = [("theirs", tf), ("ours", of)] if rnd % 2 == 0 else [("ours", of), ("theirs", tf)]
            for side, f in order:
                r = theirs(args, f) if side == "theirs" else ours(args, f)
                results[i][side].append(r)
                print(f"round {rnd + 1} {side} {f}: {r}", file=sys.stderr)
    lines = [
        f"| ours | MB/token | tg{args.n} | pp{args.p} | llama.cpp | MB/token | tg{args.n} | pp{args.p} "
        "| tg ratio | pp ratio |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (ol, of, tl, tf) in enumerate(pairs):
        o, t = results[i]["ours"], results[i]["theirs"]
        cols = []
        for side, label in ((o, ol), (t, tl)):
            cols.append(label)
            cols.append(f"{side[0]['bytes'] / 1e6:.1f}")
            for key in ("tg", "pp"):
                vals = [r[key] for r in side if key in r]
                cols.append(fmt(vals) if vals else "-")
        ratios = []
        for key in ("tg", "pp"):
            ov = [r[key] for r in o if key in r]
            tv = [r[key] for r in t if key in r]
            ratios.append(f"{statistics.mean(ov) / statistics.mean(tv):.2f}×" if ov and tv else "-")
        lines.append("| " + " | ".join(cols + ratios) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")


if __name__ == "__main__":
    main()
