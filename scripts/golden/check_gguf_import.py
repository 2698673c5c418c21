#!/usr/bin/env python3
"""Checks a folder written by `sfx-convert import-gguf` against gguf-py's own dequantization:
for each tensor named (default: a sample of every kind), gguf-py 0.19.0 dequantizes the GGUF
tensor, llama.cpp's Q/K row permutation is undone (llama/mistral: GGUF row h*d + 2i + s holds
Hugging Face row h*d + s*d/2 + i), the values are rounded to BF16 (nearest even) and compared
bit for bit with model.safetensors. Reads the safetensors header itself (no torch).

    python3 -m venv /tmp/ggufpy && /tmp/ggufpy/bin/pip install gguf==0.19.0 numpy
    /tmp/ggufpy/bin/python scripts/golden/check_gguf_import.py MODEL.gguf FOLDER [--all]

Exit 0 when every checked tensor is identical; 1 naming the first that is not.
"""
import argparse
import json
import re
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm"}


def hf_name(name):
    if name in GLOBAL:
        return GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)", name)
    if not m or m.group(2) not in LAYER:
        return None
    return f"model.layers.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"


def bf16_bits(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def unpermute(w, n_head):
    rows = w.shape[0]
    d = rows // n_head
    out = w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return out.reshape(w.shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("folder")
    ap.add_argument("--all", action="store_true", help="every tensor, not a sample")
    a = ap.parse_args()
    r = GGUFReader(a.gguf)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    heads = int(r.fields[f"{arch}.attention.head_count"].parts[-1][0])
    kv = f"{arch}.attention.head_count_kv"
    kv_heads = int(r.fields[kv].parts[-1][0]) if kv in r.fields else heads
    permuted = arch in ("llama", "mistral")

    path = f"{a.folder}/model.safetensors"
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)

    checked = 0
    for t in r.tensors:
        hf = hf_name(t.name)
        if hf is None:
            continue
        if not a.all and not (t.name.startswith("blk.0.") or t.name.startswith("blk.31.")
                              or "." not in t.name.removesuffix(".weight")):
            continue
        w = dequantize(t.data, t.tensor_type)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim == 1 and len(t.shape) > 1 else w
        if permuted and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            w = unpermute(w, heads if t.name.split(".")[-2] == "attn_q" else kv_heads)
        h = header[hf]
        s, e = h["data_offsets"]
        got = np.frombuffer(data[s:e], dtype="<u2")
        want = bf16_bits(np.ascontiguousarray(w).reshape(-1))
        if h["dtype"] != "BF16" or list(h["shape"]) != list(w.shape) or not np.array_equal(got, want):
            bad = int(np.argmax(got != want)) if got.shape == want.shape else -1
            print(f"{hf} ({t.name}, {t.tensor_type.name}): differs (shape {h['shape']} vs "
                  f"{list(w.shape)}, first differing element {bad})")
            sys.exit(1)
        checked += 1
        print(f"ok {hf:45s} {t.tensor_type.name:5s} {list(w.shape)}")
    print(f"{checked} tensors identical to gguf-py's dequantization rounded to BF16")


if __name__ == "__main__":
    main()
