#!/usr/bin/env python3
"""Write a Llama-3.1-8B-shaped GGUF with random but valid quantized blocks, for measuring
the GGUF importer's memory and time on a model of that size (no 8B checkpoint is needed).

Shape: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, feed-forward 14336, vocabulary
128256, RoPE base 500000. Tensor types follow llama.cpp's Q2_K mix for this model (Q2_K by
default, the token embedding too; attn_v Q4_K; attn_output and ffn_down Q3_K; output Q6_K;
norms F32) or `--mix q4_0` (Q4_0 everywhere, output Q6_K). Blocks are random bytes with their
f16 super-block scales set to small positive values, so every weight is finite and of order
1e-2; one random block pattern per tensor shape is shared by every tensor of that shape.

The vocabulary (tokenizer.ggml.* keys) is copied from `--tokenizer-from`, a GGUF with a
vocabulary the importer supports (the project's SmolLM2 asset: 49152 tokens, fewer than the
embedding's rows, which the importer allows).

Needs the `gguf` (0.19.0) and `numpy` packages:
    python3 -m venv /tmp/ggufpy && /tmp/ggufpy/bin/pip install gguf==0.19.0 numpy
    /tmp/ggufpy/bin/python scripts/make_synthetic_gguf.py /tmp/llama8b-q2_k.gguf \\
        --tokenizer-from assets/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256

# (elements per block, bytes per block, byte offsets of the block's f16 scales) — from the
# ggml block layouts: Q2_K scales[16] qs[64] d dmin; Q3_K hmask[32] qs[64] scales[12] d;
# Q4_K d dmin scales[12] qs[128]; Q6_K ql[128] qh[64] scales[16] d; Q4_0 d qs[16].
BLOCKS = {
    T.Q2_K: (256, 84, (80, 82)),
    T.Q3_K: (256, 110, (108,)),
    T.Q4_K: (256, 144, (0, 2)),
    T.Q6_K: (256, 210, (208,)),
    T.Q4_0: (32, 18, (0,)),
}
SCALE = {T.Q2_K: 2e-3, T.Q3_K: 7e-4, T.Q4_K: 1e-4, T.Q6_K: 3e-5, T.Q4_0: 5e-3}


def tensor_types(mix):
    if mix == "q4_0":
        return dict(embd=T.Q4_0, output=T.Q6_K, q=T.Q4_0, k=T.Q4_0, v=T.Q4_0, o=T.Q4_0,
                    gate=T.Q4_0, up=T.Q4_0, down=T.Q4_0)
    return dict(embd=T.Q2_K, output=T.Q6_K, q=T.Q2_K, k=T.Q2_K, v=T.Q4_K, o=T.Q3_K,
                gate=T.Q2_K, up=T.Q2_K, down=T.Q3_K)


def random_blocks(rng, ty, rows, cols):
    per_block, nbytes, scale_at = BLOCKS[ty]
    n_blocks = rows * cols // per_block
    pattern = rng.integers(0, 256, size=(min(n_blocks, 4096), nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(SCALE[ty]).tobytes(), dtype=np.uint8)
    for at in scale_at:
        pattern[:, at:at + 2] = scale
    reps = -(-n_blocks // len(pattern))
    return np.tile(pattern, (reps, 1))[:n_blocks].reshape(rows, cols // per_block * nbytes)


def copy_vocabulary(writer, path):
    reader = GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i][0].item() for i in field.data]
            writer.add_array(key, values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(key, bool(field.parts[field.data[0]][0]))
        else:
            writer.add_uint32(key, int(field.parts[field.data[0]][0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--mix", choices=["q2_k", "q4_0"], default="q2_k")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    ty = tensor_types(a.mix)

    w = GGUFWriter(a.out, "llama")
    w.add_name(f"synthetic Llama-3.1-8B shape ({a.mix} mix)")
    w.add_block_count(LAYERS)
    w.add_context_length(131072)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    copy_vocabulary(w, a.tokenizer_from)

    shared = {}

    def blocks(kind, rows, cols):
        key = (ty[kind], rows, cols)
        if key not in shared:
            shared[key] = random_blocks(rng, ty[kind], rows, cols)
        return shared[key]

    def add(name, kind, rows, cols):
        w.add_tensor(name, blocks(kind, rows, cols), raw_dtype=ty[kind])

    norm = np.ones(HIDDEN, dtype=np.float32)
    add("token_embd.weight", "embd", VOCAB, HIDDEN)
    add("output.weight", "output", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", norm)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm)
        w.add_tensor(p + "ffn_norm.weight", norm)
        add(p + "attn_q.weight", "q", HEADS * HEAD_DIM, HIDDEN)
        add(p + "attn_k.weight", "k", KV_HEADS * HEAD_DIM, HIDDEN)
        add(p + "attn_v.weight", "v", KV_HEADS * HEAD_DIM, HIDDEN)
        add(p + "attn_output.weight", "o", HIDDEN, HEADS * HEAD_DIM)
        add(p + "ffn_gate.weight", "gate", FFN, HIDDEN)
        add(p + "ffn_up.weight", "up", FFN, HIDDEN)
        add(p + "ffn_down.weight", "down", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
