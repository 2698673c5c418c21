#!/usr/bin/env python3
"""Writes tests/fixtures/iq_dequant_reference.json: random but valid blocks of every i-quant
type that sfx decodes, with gguf-py's dequantization of them (the independent reference for
formats/tests/gguf_iq_reference.rs).

Each type gets N_BLOCKS blocks of uniformly random bytes, except the f16 scale d, which is
drawn from a few magnitudes and both signs (random bytes would give inf/NaN scales, where only
NaN payload rules would be compared). One extra block has d = 0 (every output ±0) and one a
subnormal d. The reference is `gguf.quants.dequantize(bytes, type)`, float32, stored as the
little-endian bytes of each value in hex, so the test compares bit patterns.

Run from the repo root, in a venv with the pinned gguf and numpy of requirements.txt (these two
are all it needs; scripts/golden/README.md):
    python3 -m venv /work/pyref && /work/pyref/bin/pip install gguf==0.19.0 numpy==2.4.6
    /work/pyref/bin/python scripts/golden/make_iq_fixtures.py
Deterministic: the same versions give the same file.
--check-ggml PATH/libggml-base.so also runs ggml's own C `dequantize_row_*` (a llama.cpp CPU
build) on the same blocks and exits non-zero unless it equals gguf-py bit for bit.
"""
import argparse
import ctypes
import json
import os
from importlib.metadata import version

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

OUT = "tests/fixtures/iq_dequant_reference.json"
SEED = 20261206
N_BLOCKS = 2
TYPES = [T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S]


def blocks_for(qtype, rng):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    # IQ4_NL blocks hold 32 weights: use 8× as many to cover as many codes as the others.
    n = N_BLOCKS * (256 // block_size)
    raw = rng.integers(0, 256, size=(n + 2, type_size), dtype=np.uint8)
    mags = np.array([1e-4, 3e-3, 0.02, 0.7, 5.0, 300.0], dtype=np.float32)
    d = rng.choice(mags, size=n + 2) * rng.uniform(0.5, 2.0, size=n + 2).astype(np.float32)
    d *= rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=n + 2)
    d = d.astype(np.float16)
    d[n] = np.float16(0.0)
    d[n + 1] = np.frombuffer(np.uint16(0x0123).tobytes(), dtype=np.float16)[0]  # subnormal
    # every i-quant block starts with its f16 scale
    raw[:, 0:2] = d.reshape(-1, 1).view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1), (n + 2) * block_size


def check_ggml(lib_path, cases):
    lib = ctypes.CDLL(lib_path)
    for c in cases:
        fn = getattr(lib, "dequantize_row_" + c["type"].lower())
        blocks = np.frombuffer(bytes.fromhex(c["blocks_hex"]), dtype=np.uint8).copy()
        want = np.frombuffer(bytes.fromhex(c["f32_le_hex"]), dtype="<f4")
        out = np.zeros(c["n_values"], dtype=np.float32)
        fn(blocks.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
           ctypes.c_int64(c["n_values"]))
        if not np.array_equal(out.view(np.uint32), want.view(np.uint32)):
            raise SystemExit(f"{c['type']}: ggml's dequantize_row differs from gguf-py")
        print(f"{c['type']}: ggml C equals gguf-py on {c['n_values']} values")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-ggml", metavar="LIBGGML_BASE_SO")
    args = ap.parse_args()
    rng = np.random.default_rng(SEED)
    cases = []
    for qtype in TYPES:
        data, n_values = blocks_for(qtype, rng)
        out = quants.dequantize(data, qtype)
        assert out.dtype == np.float32 and out.size == n_values, qtype.name
        assert np.all(np.isfinite(out)), qtype.name
        cases.append({
            "type": qtype.name,
            "type_id": int(qtype),
            "n_values": n_values,
            "blocks_hex": data.tobytes().hex(),
            "f32_le_hex": out.astype("<f4").tobytes().hex(),
        })
    doc = {
        "source": f"gguf-py {version('gguf')} gguf.quants.dequantize, numpy {np.__version__}; "
                  "made by scripts/golden/make_iq_fixtures.py",
        "seed": SEED,
        "cases": cases,
    }
    if args.check_ggml:
        check_ggml(args.check_ggml, cases)
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, OUT)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
