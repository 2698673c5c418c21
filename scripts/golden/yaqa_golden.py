#!/usr/bin/env python3
"""Independent reference for YAQA Sketch B per-sequence gradients (calibration/src/yaqa).

For one fixed sequence (the first 48 tokens of the canonical wiki text, tokenized like the other
goldens: no BOS, no special tokens) and labels y_t sampled once from the float model's own
next-token distribution (torch.manual_seed(SEED), temperature 1, torch.multinomial on the float64
softmax of the float32 logits; stored, so the Rust side uses the same labels):

    loss = sum_t -log p(y_t | x_<=t)            (sum over all 48 positions, not mean)
    G    = sum_t g_t x_t^T  (out x in)           g_t = dloss/d(linear output at t), x_t = its input

x and g are captured with forward / full-backward hooks on the nn.Linear modules and G is formed
in float64 from them (not read from weight.grad; weight.grad is only used as a cross-check). The
whole computation is done twice, with the model in float32 (as the Rust code runs) and in float64;
the float64 results are stored as the reference, and the float32-vs-float64 relative differences
are stored under "f32_vs_f64" to show the scale of f32 rounding the Rust tolerance must allow.

Stored per captured linear (model.layers.L.<proj>.weight): shape, Frobenius norm of G, the norm of
every row of G, of every column of G, and G @ r for a fixed pseudo-random r (stored as well;
r = uniform[-1, 1) from numpy default_rng(R_SEED + index of the linear)).

Model loading: common.load_model (transformers' GGUF loader, every tensor dequantized to float32;
see make_golden.py for the Q/K row un-permutation). 2 torch threads. ~1 minute.

Writes tests/fixtures/yaqa_golden.json.
"""
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import texts  # noqa: E402
from common import f32, f64  # noqa: E402

N_TOKENS = 48
SEED = 20250528
R_SEED = 777
LINEARS = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.14.self_attn.v_proj",
    "model.layers.14.self_attn.o_proj",
    "model.layers.29.mlp.gate_proj",
    "model.layers.29.mlp.up_proj",
    "model.layers.29.mlp.down_proj",
]


def sequence_tokens(tok):
    # The Rust tests tokenize the first 20000 characters; the first 48 tokens are the same.
    text = texts.wiki_text()[:20000]
    ids = tok(text, add_special_tokens=False).input_ids
    return ids[:N_TOKENS]


def sample_labels(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids], dtype=torch.long)).logits[0].double()
    probs = torch.softmax(logits, dim=-1)
    gen = torch.Generator().manual_seed(SEED)
    return torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()


def gradients(model, ids, labels):
    """loss and, per captured linear, G = g^T x in float64 from hooked x and g."""
    mods = dict(model.named_modules())
    xs, gs, handles = {}, {}, []
    for name in LINEARS:
        m = mods[name]
        handles.append(m.register_forward_hook(
            lambda mod, inp, out, name=name: xs.__setitem__(name, inp[0].detach()[0])))
        handles.append(m.register_full_backward_hook(
            lambda mod, gin, gout, name=name: gs.__setitem__(name, gout[0].detach()[0])))
    model.zero_grad(set_to_none=True)
    logits = model(torch.tensor([ids], dtype=torch.long)).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    loss = -logp.gather(1, torch.tensor(labels)[:, None]).sum()
    loss.backward()
    for h in handles:
        h.remove()
    out = {}
    for name in LINEARS:
        g = gs[name].double()  # [T, out]
        x = xs[name].double()  # [T, in]
        G = g.T @ x
        wg = mods[name].weight.grad.double()
        rel = float((G - wg).norm() / G.norm())
        assert rel < 1e-4, (name, rel)  # hooks and autograd's own weight gradient agree
        out[name] = G.numpy()
    return float(loss.detach()), out


def stats(G, r):
    return {
        "fro": float(np.linalg.norm(G)),
        "row_norms": np.linalg.norm(G, axis=1),
        "col_norms": np.linalg.norm(G, axis=0),
        "g_r": G @ r,
    }


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def main():
    torch.set_num_threads(2)
    t0 = time.time()
    tok = common.load_tokenizer()
    model = common.load_model(torch.float32)
    ids = sequence_tokens(tok)
    labels = sample_labels(model, ids)

    loss32, g32 = gradients(model, ids, labels)
    model64 = model.double()
    loss64, g64 = gradients(model64, ids, labels)

    linears, f32_vs_f64 = {}, {}
    for i, name in enumerate(LINEARS):
        G = g64[name]
        r = np.random.default_rng(R_SEED + i).uniform(-1.0, 1.0, G.shape[1]).astype(np.float32)
        s64 = stats(G, r.astype(np.float64))
        s32 = stats(g32[name], r.astype(np.float64))
        linears[name + ".weight"] = {
            "rows": G.shape[0], "cols": G.shape[1],
            "fro": f64(s64["fro"]),
            "row_norms": [f32(v) for v in s64["row_norms"]],
            "col_norms": [f32(v) for v in s64["col_norms"]],
            "r": [f32(v) for v in r],
            "g_r": [f32(v) for v in s64["g_r"]],
        }
        f32_vs_f64[name + ".weight"] = {
            k: f64(rel(s32[k], s64[k]), 3) for k in ("fro", "row_norms", "col_norms", "g_r")
        }
    f32_vs_f64["loss"] = f64(abs(loss32 - loss64) / abs(loss64), 3)

    out = {
        "description": __doc__.split("\n\n")[0],
        "versions": common.versions(),
        "seed": SEED,
        "tokens": ids,
        "labels": labels,
        "loss": f64(loss64),
        "loss_f32": f64(loss32),
        "linears": linears,
        "f32_vs_f64": f32_vs_f64,
    }
    path = os.path.join(common.FIXTURES, "yaqa_golden.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print("wrote %s (%d bytes) in %.0fs; loss %.6f; f32 vs f64: %s" % (
        path, os.path.getsize(path), time.time() - t0, loss64, json.dumps(f32_vs_f64)))


if __name__ == "__main__":
    main()
