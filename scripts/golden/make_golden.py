#!/usr/bin/env python3
"""Independent golden outputs for SmolLM2-135M-Instruct.Q4_1.gguf made with PyTorch + transformers.

Writes
  tests/fixtures/golden_smollm2.json         token ids, per-position top-32 logits + logsumexp,
                                              full last-position logits (prompts 0 and 1), greedy
                                              generations, per-layer residual-stream probes
  tests/fixtures/gguf_dequant_reference.json per-tensor checksums/samples of gguf's dequantization
                                              (raw GGUF row order) + "hf_layout" for layer-0 q/k

Model: AutoModelForCausalLM.from_pretrained(assets, gguf_file=..., dtype=float32): every tensor is
dequantized by gguf.quants.dequantize (float32) and held in float32; computation is float32 on CPU
(attention: transformers' default "sdpa"). lm_head is tied to embed_tokens (no output.weight in the
GGUF). Tokenizer: transformers' GGUF tokenizer with the pre-tokenizer replaced by llama.cpp's
"smollm" pre-tokenizer (see common.py; transformers 5.24 leaves the plain GPT-2 ByteLevel regex for
pre-tokenizer type "smollm"). No BOS and no special tokens are added, except where the chat
template writes them.

How transformers maps GGUF tensors (transformers/modeling_gguf_pytorch_utils.py, 5.24.0):
names go through gguf-py's tensor name map for arch "llama" (token_embd -> model.embed_tokens,
blk.N.attn_q/attn_k/attn_v/attn_output -> model.layers.N.self_attn.{q,k,v,o}_proj,
blk.N.ffn_gate/ffn_up/ffn_down -> model.layers.N.mlp.{gate,up,down}_proj, blk.N.attn_norm ->
input_layernorm, blk.N.ffn_norm -> post_attention_layernorm, output_norm -> model.norm).
The dequantized numpy array of a GGUF tensor with GGUF shape [ne0, ne1] has numpy shape
(ne1, ne0) = (out_features, in_features), which is used as the nn.Linear weight unchanged,
except for attn_q / attn_k, which LlamaTensorProcessor._reverse_permute_weights un-permutes:

    n_head = num_attention_heads (q) or num_key_value_heads (k)
    dim    = rows // n_head // 2                      # = head_dim / 2 = 32 here
    w = weights.reshape(n_head, dim, 2, in_features)  # GGUF row h*head_dim + 2*i + j
    w = w.swapaxes(2, 1).reshape(weights.shape)       # HF   row h*head_dim + j*dim + i

i.e. for head h, i in [0, head_dim/2), j in {0, 1}:
    HF_row(h*head_dim + j*(head_dim/2) + i) = GGUF_row(h*head_dim + 2*i + j)
GGUF (llama.cpp) keeps each rotary pair (x[2i], x[2i+1]) adjacent ("interleaved"/NORM RoPE);
HF's rotate_half pairs x[i] with x[i + head_dim/2] ("NEOX" layout). Both give identical logits.
This script re-derives that permutation itself and checks it against the loaded parameters.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import f32, f64  # noqa: E402

TOPK = 32
SEED = 20240607

PROMPTS = [
    ("prose",
     "The old lighthouse keeper climbed the spiral stairs every evening, carrying a lantern and a "
     "worn notebook in which he recorded the weather, the ships that passed, and the birds that "
     "rested on the railing."),
    ("code",
     "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
     "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nprint([fibonacci(i) for i "
     "in range(10)])\n"),
    ("digits",
     "In 2024 there were 12345 cats, 3.14159 pies and 1,000,000 dollars.\n\n2001: A Space Odyssey "
     "(1968) cost $10.5M; call 555-0199 at 07:45. x2 = 2^10 = 1024, ½ and ² and ٣."),
    ("unicode",
     "Café, naïve résumé — Zürich, São Paulo, Ærøskøbing; 東京は日本の首都です。 Москва. "
     "Emoji: 🦀🚀👍🏽 «quotes» “curly” ‘single’ … ©®™ ∑∞≠ \u00a0nbsp\u200bzwsp"),
    ("whitespace",
     "  leading spaces\n\n\nthree newlines\tone tab\t\ttwo tabs    four spaces\n    indented "
     "line\r\nCRLF line\n \n\t\n  mixed   runs  \n\n\n\n   trailing   "),
    ("chat", None),  # rendered by the chat template, see below
]
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
FULL_LOGITS_PROMPTS = {"prose", "code"}  # full last-position logit vector stored for these
GREEDY = {"chat": 24, "prose": 24}


def prompt_ids(tok, name, text):
    if name == "chat":
        text = tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    return text, ids


@torch.no_grad()
def logits_of(model, ids):
    return model(torch.tensor([ids], dtype=torch.long)).logits[0]


def topk_record(row32):
    """row32: float32 numpy (vocab,). Top-32 by logit descending, ties by id ascending."""
    order = np.lexsort((np.arange(row32.shape[0]), -row32.astype(np.float64)))[:TOPK]
    r64 = row32.astype(np.float64)
    mx = r64.max()
    lse = mx + math.log(np.exp(r64 - mx).sum())
    return [int(i) for i in order], [f32(row32[i]) for i in order], lse


def _argmax_order(row):
    return np.lexsort((np.arange(row.shape[0]), -row.astype(np.float64)))


@torch.no_grad()
def greedy(model, ids, n):
    """Plain greedy decoding: full forward over the whole sequence each step (no KV cache)."""
    seq = list(ids)
    out, margins, rows = [], [], []
    for _ in range(n):
        row = logits_of(model, seq)[-1].numpy()
        order = _argmax_order(row)
        nxt = int(order[0])
        margins.append(float(row[order[0]]) - float(row[order[1]]))
        rows.append(row)
        out.append(nxt)
        seq.append(nxt)
    return out, margins, rows


@torch.no_grad()
def greedy_kv(model, ids, n):
    """Greedy decoding through transformers' KV cache: prefill, then one token per forward."""
    o = model(torch.tensor([ids], dtype=torch.long), use_cache=True)
    pkv, row = o.past_key_values, o.logits[0, -1].numpy()
    out, rows = [], []
    for _ in range(n):
        rows.append(row)
        nxt = int(_argmax_order(row)[0])
        out.append(nxt)
        o = model(torch.tensor([[nxt]], dtype=torch.long), past_key_values=pkv, use_cache=True)
        pkv, row = o.past_key_values, o.logits[0, -1].numpy()
    return out, rows


@torch.no_grad()
def residual_probes(model, ids):
    """Residual stream at the last position: embedding output, after each decoder layer, and the
    final RMSNorm output (the lm_head input)."""
    caps = {}
    hooks = [model.model.embed_tokens.register_forward_hook(
        lambda m, i, o: caps.__setitem__("embed", o[0, -1].clone()))]
    for li, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o, li=li: caps.__setitem__("layer_%d" % li,
                                                    (o[0] if isinstance(o, tuple) else o)[0, -1].clone())))
    hooks.append(model.model.norm.register_forward_hook(
        lambda m, i, o: caps.__setitem__("final_norm", o[0, -1].clone())))
    model(torch.tensor([ids], dtype=torch.long))
    for h in hooks:
        h.remove()
    order = ["embed"] + ["layer_%d" % i for i in range(len(model.model.layers))] + ["final_norm"]
    out = []
    for k in order:
        v = caps[k].numpy()
        rec = {"name": k, "l2": f64(np.linalg.norm(v.astype(np.float64)), 9),
               "sum": f64(v.astype(np.float64).sum(), 9)}
        if k in ("embed", "layer_0", "final_norm"):
            rec["values"] = [f32(x) for x in v]
        else:
            rec["first8"] = [f32(x) for x in v[:8]]
        out.append(rec)
    return out


def make_golden(tok, model, model64):
    torch.manual_seed(0)
    prompts = []
    for name, text in PROMPTS:
        text, ids = prompt_ids(tok, name, text)
        dec = tok.decode(ids)
        assert dec == text, (name, dec, text)
        lg = logits_of(model, ids).numpy()
        lg64 = logits_of(model64, ids).numpy()
        rec = {"name": name, "text": text, "ids": ids,
               "tokens": tok.convert_ids_to_tokens(ids),
               "decode_roundtrip": dec == text,
               "n": len(ids),
               "top_ids": [], "top_logits": [], "logsumexp": [], "argmax": []}
        for p in range(len(ids)):
            ti, tl, lse = topk_record(lg[p])
            rec["top_ids"].append(ti)
            rec["top_logits"].append(tl)
            rec["logsumexp"].append(f64(lse, 10))
            rec["argmax"].append(ti[0])
        d = np.abs(lg.astype(np.float64) - lg64)
        rec["fp32_vs_fp64_max_abs_logit_diff"] = f64(d.max(), 4)
        rec["fp32_vs_fp64_mean_abs_logit_diff"] = f64(d.mean(), 4)
        if name in FULL_LOGITS_PROMPTS:
            rec["last_logits"] = [f32(x) for x in lg[-1]]
        if name in GREEDY:
            g, margins, rows = greedy(model, ids, GREEDY[name])
            # cross-check through transformers' KV-cache decode path
            gk, rows_k = greedy_kv(model, ids, GREEDY[name])
            eos = tok.eos_token_id
            rec["greedy"] = {"n_new": GREEDY[name], "ids": g, "text": tok.decode(g),
                             "first_eos_index": g.index(eos) if eos in g else None,
                             "min_top1_top2_margin": f64(min(margins), 6),
                             "matches_kv_cache_decode": gk == g}
            if gk == g:
                rec["greedy"]["kv_cache_vs_full_max_abs_logit_diff"] = f64(
                    max(np.abs(a - b).max() for a, b in zip(rows, rows_k)), 4)
            else:
                rec["greedy"]["kv_cache_ids"] = gk
        if name == "prose":
            rec["residual_probes_last_position"] = residual_probes(model, ids)
        prompts.append(rec)
        print("%-10s n=%-3d fp32-vs-fp64 max|dlogit|=%.3g  argmax(last)=%d %r" % (
            name, len(ids), rec["fp32_vs_fp64_max_abs_logit_diff"], rec["argmax"][-1],
            tok.decode([rec["argmax"][-1]])), file=sys.stderr)
        if "greedy" in rec:
            print("   greedy:", repr(rec["greedy"]["text"]), "kv-cache match:",
                  rec["greedy"]["matches_kv_cache_decode"], file=sys.stderr)

    # tokenizer quirk: what transformers' unpatched GGUF tokenizer would have produced
    raw_tok = common.load_tokenizer(fix=False)
    unfixed = {}
    for rec in prompts:
        ids2 = raw_tok(rec["text"], add_special_tokens=False).input_ids
        if ids2 != rec["ids"]:
            unfixed[rec["name"]] = ids2
    return {
        "model": common.GGUF_NAME,
        "versions": common.versions(),
        "notes": {
            "dtype": "float32 weights (gguf dequantize) and float32 compute, CPU, attn=sdpa",
            "tokenizer": "transformers GGUF tokenizer + pre_tokenizer Sequence[Split(\\p{N}, isolated), "
                         "ByteLevel(add_prefix_space=False, use_regex=True)] (llama.cpp 'smollm'); "
                         "no BOS; chat prompt rendered by the GGUF chat template "
                         "(apply_chat_template, add_generation_prompt=True) then tokenized with "
                         "add_special_tokens=False",
            "top": "top_ids/top_logits: 32 largest logits per position, descending, ties by id; "
                   "float32 values written as the shortest decimal that round-trips the float32",
            "logsumexp": "log(sum(exp(logits))) over all 49152 logits, computed in float64 from the "
                         "float32 logits; log p(id) = logit(id) - logsumexp",
            "fp32_vs_fp64": "max/mean |logit_fp32 - logit_fp64| where fp64 = the same dequantized "
                            "weights run in float64: the scale of pure float32 rounding noise",
            "last_logits": "all 49152 float32 logits at the last position (prompts prose, code)",
            "greedy": "argmax decoding (ties by lowest id) for n_new steps, full recompute each "
                      "step; EOS (<|im_end|>, id 2) is not special-cased, decoding goes on past it; "
                      "cross-checked against a prefill + one-token-per-step KV-cache loop",
            "residual_probes": "prose prompt, last position: embedding output, output of each "
                               "decoder layer (residual stream), final RMSNorm output",
        },
        "unpatched_transformers_tokenizer_ids": unfixed,
        "prompts": prompts,
    }


# ------------------------------------------------------------------------------------------------
def fsum_stats(x):
    """Exactly rounded float64 sum and sum of squares (squares of float32 values are exact in
    float64; math.fsum is correctly rounded), so any careful consumer can match to ~1 ulp."""
    v = x.astype(np.float64).ravel()
    return math.fsum(v), math.fsum(v * v)


def sample(x, rng, k=16):
    flat = x.ravel()
    idx = np.sort(rng.choice(flat.shape[0], size=k, replace=False))
    vals = flat[idx].astype(np.float32)
    return ([int(i) for i in idx], [f32(v) for v in vals],
            ["%08x" % int(b) for b in vals.view(np.uint32)])


def reverse_permute(w, n_head):
    # independent re-statement of the GGUF -> HF row order (see module docstring)
    rows = w.shape[0]
    hd = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(2):
            for i in range(hd // 2):
                out[h * hd + j * (hd // 2) + i] = w[h * hd + 2 * i + j]
    return out


def make_dequant_reference(model):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(common.GGUF_PATH)
    rng = np.random.default_rng(SEED)
    tensors = []
    raw = {}
    total = 0
    for t in reader.tensors:
        x = dequantize(t.data, t.tensor_type)
        assert x.dtype == np.float32, x.dtype
        shape = [int(s) for s in t.shape]  # GGUF order: ne0 (contiguous) first
        assert x.size == int(np.prod(shape))
        s, ss = fsum_stats(x)
        idx, vals, bits = sample(x, rng)
        tensors.append({"name": t.name, "type": t.tensor_type.name, "type_id": int(t.tensor_type),
                        "shape": shape, "n_elements": int(x.size), "sum": s, "sumsq": ss,
                        "sample_flat_index": idx, "sample_value": vals, "sample_f32_bits": bits})
        total += x.size
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            raw[t.name] = x.reshape(shape[::-1])
    print("dequantized %d tensors, %d values" % (len(tensors), total), file=sys.stderr)

    cfg = model.config
    hf = {}
    for gname, hname, nh in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight",
                              cfg.num_attention_heads),
                             ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight",
                              cfg.num_key_value_heads)):
        w = dict(model.named_parameters())[hname].detach().numpy()
        mine = reverse_permute(raw[gname], nh)
        assert np.array_equal(mine, w), "un-permutation mismatch for " + hname
        s, ss = fsum_stats(w)
        flat_idx, vals, bits = sample(w, rng)
        rc = [[int(i // w.shape[1]), int(i % w.shape[1])] for i in flat_idx]
        hf[hname] = {"gguf_name": gname, "shape": list(w.shape), "n_head_for_permute": int(nh),
                     "sum": s, "sumsq": ss, "sample_row_col": rc, "sample_value": vals,
                     "sample_f32_bits": bits}
    emb = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert model.lm_head.weight.data_ptr() == emb.data_ptr(), "lm_head is not tied"
    return {
        "file": common.GGUF_NAME,
        "versions": common.versions(),
        "seed": SEED,
        "notes": {
            "dequant": "gguf.quants.dequantize (gguf-py), float32 output. Q4_1: (d*q) + m with d, m "
                       "f16->f32, two float32 roundings (no FMA); Q8_0: d*q; F32 copied",
            "shape": "as GGUFReader reports it: [ne0, ne1, ...], ne0 contiguous",
            "flat_index": "index into the dequantized values in the GGUF's own raw order "
                          "(row-major over [..., ne1, ne0]; before any Q/K un-permutation)",
            "sum_sumsq": "math.fsum over float64(value) and float64(value)^2: exactly rounded",
            "sampling": "numpy default_rng(seed), per tensor in file order: choice(n, 16, "
                        "replace=False) sorted; then the two hf_layout tensors",
            "hf_layout": "transformers' loaded parameters (HF [out, in] layout, after the Q/K "
                         "un-permutation HF_row(h*hd + j*hd/2 + i) = GGUF_row(h*hd + 2i + j)); "
                         "sample_row_col = [row, col]",
            "tied": "no output.weight in the GGUF: lm_head.weight is model.embed_tokens.weight",
        },
        "n_tensors": len(tensors),
        "n_values": int(total),
        "tensors": tensors,
        "hf_layout": hf,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-golden", action="store_true")
    ap.add_argument("--skip-dequant", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    tok = common.load_tokenizer()
    model = common.load_model(torch.float32)
    os.makedirs(common.FIXTURES, exist_ok=True)
    if not args.skip_golden:
        model64 = common.load_model(torch.float32).double()
        g = make_golden(tok, model, model64)
        g["wall_s"] = round(time.time() - t0, 1)
        path = os.path.join(common.FIXTURES, "golden_smollm2.json")
        with open(path, "w") as f:
            json.dump(g, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        print("wrote", path, os.path.getsize(path), "bytes", file=sys.stderr)
        del model64
    if not args.skip_dequant:
        d = make_dequant_reference(model)
        path = os.path.join(common.FIXTURES, "gguf_dequant_reference.json")
        with open(path, "w") as f:
            json.dump(d, f, indent=None, separators=(",", ":"))
            f.write("\n")
        print("wrote", path, os.path.getsize(path), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
