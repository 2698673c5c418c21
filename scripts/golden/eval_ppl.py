#!/usr/bin/env python3
"""Independent float32 PyTorch/transformers evaluation per docs/method.md §7 ("Evaluation protocol").

wiki:8            tokenize the whole canonical wiki text (no BOS, no special tokens); consecutive
                  non-overlapping 2048-token windows; the first 8; each window a fresh forward
                  (empty cache); every position after the first is scored (2047 per window).
austen-long:2048  for emma, mansfieldpark, prideprejudice, sensesensibility: the last 2048 tokens
                  of the novel; score the final 256 (target positions 1792..2047, each predicted
                  from its full prefix). One causal forward over the 2048 tokens is mathematically
                  the same as prefill(1792) + teacher forcing; this is verified for emma through
                  transformers' KV cache, one token per step.

NLL of target t at position p = logsumexp(logits[p-1]) - logits[p-1][t], computed in float64
from the float32 logits. PPL = exp(mean NLL). "+/-" as llama-perplexity prints it:
PPL * sqrt(var_pop(NLL) / (n - 1)) (standard error of the mean NLL, propagated through exp).

Writes tests/fixtures/transformers_eval.json.
"""
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import texts  # noqa: E402
from common import f64  # noqa: E402

W = 2048
WIKI_WINDOWS = 8
LONG_L = 2048
LONG_SCORED = 256
LONG_NOVELS = ["emma", "mansfieldpark", "prideprejudice", "sensesensibility"]


def stats(nlls):
    a = np.asarray(nlls, dtype=np.float64)
    n = a.size
    mean = a.mean()
    var = max(0.0, float((a * a).mean() - mean * mean))
    unc = math.sqrt(var / (n - 1))
    ppl = math.exp(mean)
    return {"n_scored": int(n), "mean_nll": f64(mean, 12), "ppl": f64(ppl, 10),
            "ppl_pm": f64(ppl * unc, 6), "stderr_nll": f64(unc, 6)}


@torch.no_grad()
def window_nlls(model, ids, first_target):
    """NLL of ids[p] for p in [first_target, len(ids)), one causal forward from an empty cache."""
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(x).logits[0]  # float32 [T, V]
    pred = logits[first_target - 1:len(ids) - 1].double()
    tgt = torch.tensor(ids[first_target:], dtype=torch.long)
    lse = torch.logsumexp(pred, dim=-1)
    nll = lse - pred.gather(1, tgt[:, None])[:, 0]
    return nll.numpy()


@torch.no_grad()
def teacher_forced_nlls(model, ids, first_target):
    """Same as window_nlls but through the KV cache: prefill ids[:first_target], then feed one
    token per step and score the next."""
    o = model(torch.tensor([ids[:first_target]], dtype=torch.long), use_cache=True)
    pkv, row = o.past_key_values, o.logits[0, -1]
    out = []
    for p in range(first_target, len(ids)):
        r = row.double()
        out.append(float(torch.logsumexp(r, 0) - r[ids[p]]))
        if p + 1 < len(ids):
            o = model(torch.tensor([[ids[p]]], dtype=torch.long), past_key_values=pkv, use_cache=True)
            pkv, row = o.past_key_values, o.logits[0, -1]
    return np.array(out)


def ids_fingerprint(ids):
    b = np.asarray(ids, dtype="<u4").tobytes()
    return hashlib.sha256(b).hexdigest()


def main():
    torch.set_num_threads(2)
    t0 = time.time()
    tok = common.load_tokenizer()
    model = common.load_model(torch.float32)
    t_load = time.time() - t0

    T = texts.canonical_texts()
    toks, counts = {}, {}
    t1 = time.time()
    for name, text in T.items():
        ids = tok(text, add_special_tokens=False).input_ids
        toks[name] = ids
        counts[name] = {"tokens": len(ids), "windows_2048": len(ids) // W,
                        "ids_sha256_u32le": ids_fingerprint(ids),
                        "first16": ids[:16], "last16": ids[-16:],
                        "text_sha256": texts.describe(text)["sha256"]}
        print("%-18s %8d tokens" % (name, len(ids)), file=sys.stderr)
    t_tok = time.time() - t1

    # --- wiki:8 ---------------------------------------------------------------------------------
    t2 = time.time()
    wiki = toks["wiki"]
    assert len(wiki) >= WIKI_WINDOWS * W
    all_nll, windows = [], []
    for w in range(WIKI_WINDOWS):
        ids = wiki[w * W:(w + 1) * W]
        nll = window_nlls(model, ids, 1)
        assert nll.size == W - 1
        all_nll.append(nll)
        st = stats(nll)
        windows.append({"window": w, "token_start": w * W, "n_scored": int(nll.size),
                        "mean_nll": st["mean_nll"], "ppl": st["ppl"],
                        "ids_sha256_u32le": ids_fingerprint(ids)})
        run = stats(np.concatenate(all_nll))
        print("wiki window %d: mean NLL %.6f  running PPL %.4f +/- %.5f  (%.0fs)" % (
            w, st["mean_nll"], run["ppl"], run["ppl_pm"], time.time() - t2), file=sys.stderr)
    wiki_res = stats(np.concatenate(all_nll))
    wiki_res.update({"window": W, "n_windows": WIKI_WINDOWS, "windows": windows,
                     "window0_nll_first64": [f64(x, 7) for x in all_nll[0][:64]],
                     "wall_s": round(time.time() - t2, 1)})

    # --- austen-long:2048 --------------------------------------------------------------------
    t3 = time.time()
    per, alllong = {}, []
    kv_check = None
    for name in LONG_NOVELS:
        ids = toks[name][-LONG_L:]
        assert len(ids) == LONG_L
        first = LONG_L - LONG_SCORED
        nll = window_nlls(model, ids, first)
        assert nll.size == LONG_SCORED
        alllong.append(nll)
        st = stats(nll)
        st.update({"token_start": len(toks[name]) - LONG_L, "novel_tokens": len(toks[name]),
                   "window_ids_sha256_u32le": ids_fingerprint(ids),
                   "nll": [f64(x, 7) for x in nll]})
        if name == "emma":
            tf = teacher_forced_nlls(model, ids, first)
            kv_check = {"novel": name, "max_abs_nll_diff": f64(np.abs(tf - nll).max(), 4),
                        "teacher_forced_mean_nll": f64(tf.mean(), 12)}
            print("emma KV-cache teacher forcing vs one forward: max |dNLL| = %.3g" %
                  kv_check["max_abs_nll_diff"], file=sys.stderr)
        per[name] = st
        print("austen-long %s: PPL %.4f +/- %.5f" % (name, st["ppl"], st["ppl_pm"]), file=sys.stderr)
    long_res = {"L": LONG_L, "scored_per_novel": LONG_SCORED, "novels": per,
                "overall": stats(np.concatenate(alllong)),
                "kv_cache_teacher_forcing_check": kv_check,
                "wall_s": round(time.time() - t3, 1)}
    print("austen-long overall: PPL %.4f +/- %.5f" % (long_res["overall"]["ppl"],
                                                     long_res["overall"]["ppl_pm"]), file=sys.stderr)

    out = {
        "model": common.GGUF_NAME,
        "versions": common.versions(),
        "setup": {"dtype": "float32 (gguf-dequantized weights, float32 compute)",
                  "attn_implementation": model.config._attn_implementation,
                  "torch_threads": torch.get_num_threads(),
                  "tokenizer": "transformers GGUF tokenizer + smollm pre-tokenizer fix; no BOS, "
                               "no special tokens",
                  "nll": "float64 logsumexp of the float32 logits minus the target logit",
                  "pm": "llama-perplexity style: PPL * sqrt(var_pop(NLL)/(n-1))"},
        "token_counts": counts,
        "wiki:8": wiki_res,
        "austen-long:2048": long_res,
        "wall_s": {"load": round(t_load, 1), "tokenize": round(t_tok, 1),
                   "total": round(time.time() - t0, 1)},
    }
    path = os.path.join(common.FIXTURES, "transformers_eval.json")
    os.makedirs(common.FIXTURES, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", path, file=sys.stderr)
    print("wiki:8 PPL = %.4f +/- %.5f over %d tokens" % (wiki_res["ppl"], wiki_res["ppl_pm"],
                                                       wiki_res["n_scored"]))


if __name__ == "__main__":
    main()
