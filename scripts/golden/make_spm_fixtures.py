#!/usr/bin/env python3
"""Writes tests/fixtures/spm_llama_reference.json: reference token ids for a real Llama-2
SentencePiece vocabulary (the independent reference for formats/tests/gguf_tokenizer_spm.rs).

Reads
- assets/vocab/ggml-vocab-llama-spm.gguf (scripts/fetch_assets.sh fetches it; $SFX_ASSETS if set):
  llama.cpp's vocab-only GGUF of the Llama-2 tokenizer
  (32000 pieces, `tokenizer.ggml.model = "llama"`, no tensors). It is the file
  `vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf` of the llama-cpp-python 0.3.36 sdist on
  PyPI (sha256 16c37245...0e69, checked below).
- optionally (--llama-cpp-vectors DIR) llama.cpp's own test vectors beside it in the sdist,
  ggml-vocab-llama-spm.gguf.inp/.out (texts and the ids the original Llama tokenizer gives them):
  the sentencepiece model rebuilt below must reproduce every one of them, which shows it is the
  original model in all that matters for encoding.
- the canonical texts (scripts/golden/texts.py; assets from scripts/fetch_assets.sh or
  $SFX_ASSETS).

The references, none of which reads the Rust code:
- sentencepiece: a SentencePiece ModelProto rebuilt from the GGUF's pieces, scores and token types,
  with the settings of Llama-2's tokenizer.model (BPE, byte_fallback, identity normalizer,
  add_dummy_prefix, no whitespace squeezing), encoded with `SentencePieceProcessor.encode`; BOS
  (id 1) is prepended because the GGUF says add_bos_token. This is the reference for every text
  that holds no special-token string.
- transformers' legacy Llama tokenizer: `SpmConverter.build_tokenizer_from_spm_proto(proto,
  legacy=True)` plus the control/unknown pieces as special added tokens (what LlamaTokenizerFast /
  the shipped Llama-2, Mistral-7B-v0.1 and TinyLlama tokenizer.json do): `<s>` in the text is the
  BOS token, and every stretch of text between special tokens gets its own dummy prefix. It is the
  reference for texts that contain `<s>`, `</s>` or `<unk>` (sentencepiece has no notion of them);
  for those, sentencepiece encoding each stretch separately must give the same ids. On every other
  text it must agree with sentencepiece (checked).
- transformers' own GGUF loader (non-legacy Metaspace prepend) is run too and its disagreements
  are only printed: it is not what the legacy Llama tokenizer.json files do.

The canonical texts are too long to store their ids (about 2.5 M): the fixture keeps, per text,
the id count, the SHA-256 of the ids as little-endian u32, the SHA-256 of each chunk of 65536 ids
(to locate a first difference), the first and last 64 ids and the SHA-256 of the decoded text.

Pinned versions (Python 3.11.7; no torch needed):
    python3 -m venv /work/spmref
    /work/spmref/bin/pip install sentencepiece==0.2.3 gguf==0.19.0 numpy==2.4.6 \
        transformers==5.24.0 tokenizers==0.23.3 protobuf==7.36.2
Run from the repo root (about 40 s on 2 cores):
    /work/spmref/bin/python scripts/golden/make_spm_fixtures.py --llama-cpp-vectors DIR
(DIR: the sdist's vendor/llama.cpp/models; the committed fixture was made with it, and its 46
texts are part of the fixture). Deterministic: the same versions give the same file.
"""
import argparse
import hashlib
import json
import os
import struct
import sys
from importlib.metadata import version

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import texts as canonical  # noqa: E402

REPO = canonical.REPO
GGUF_PATH = os.path.join(os.environ.get("SFX_ASSETS", os.path.join(REPO, "assets")), "vocab",
                         "ggml-vocab-llama-spm.gguf")
GGUF_SHA256 = "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69"
OUT = os.path.join(REPO, "tests", "fixtures", "spm_llama_reference.json")
CHUNK = 65536
SPECIAL_STRINGS = ("<s>", "</s>", "<unk>")

# Edge cases: whitespace runs and positions, control characters, digits, text sentencepiece can
# only write with byte fallback (emoji, rare CJK, math letters), a piece that already starts with
# the metaspace character, and special-token strings inside text.
EDGE_TEXTS = [
    ("empty", ""),
    ("space", " "),
    ("two_spaces", "  "),
    ("seventeen_spaces", " " * 17),
    ("tab", "\t"),
    ("newline", "\n"),
    ("newlines", "\n\n\n"),
    ("hello", "Hello world"),
    ("leading_space", " Hello world"),
    ("leading_spaces", "   Hello world"),
    ("trailing_spaces", "Hello world   "),
    ("inner_spaces", "Hello     world  and   more"),
    ("lines", "line one\nline two\r\nline three\n\n  indented line\n"),
    ("tabs", "col1\tcol2\t\tcol4\n\tindented"),
    ("digits", "0123456789 3.14159 1,000,000 2024-01-31 007 12345678901234567890"),
    ("punctuation", "Wait... what?! (yes) [no] {maybe} <tag> a+b=c; x->y, 50% & \"quotes\" 'single'"),
    ("latin", "naïve café — “smart quotes” ‘single’ … Äpfel Übermaß façade"),
    ("cjk", "日本語のテキスト、中文文本。한국어 텍스트"),
    ("rare_cjk", "𠀋𠂢𡈽 龘 鱻 齉"),
    ("emoji", "emoji 🦙🚀👍🏽 and 👨‍👩‍👧 end"),
    ("math_letters", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐁𝐨𝐥𝐝 ∀x∈ℝ: x²≥0"),
    ("control_chars", "bell\x07 esc\x1b del\x7f nbsp\u00a0zwsp\u200bend"),
    ("metaspace_start", "\u2581starts with a metaspace \u2581\u2581 and has more"),
    ("cyrillic_greek", "Привет, мир! Γειά σου Κόσμε"),
    ("code", "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n"),
    ("repeats", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" + "ab" * 30 + " the the the the"),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
    ("special_bos", "<s>"),
    ("special_eos", "</s>"),
    ("special_in_text", "Hello <s> world</s> again<unk>!"),
    ("special_chat", "<s>[INST] What is 2+2? [/INST] 4 </s>"),
    ("special_adjacent", "</s></s><s>x"),
    ("not_special", "< s > <s </ s> <S> <pad>"),
]


def sha256_ids(ids):
    return hashlib.sha256(struct.pack("<%dI" % len(ids), *ids)).hexdigest()


def read_vocab(path):
    r = gguf.GGUFReader(path)

    def field(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    assert field("tokenizer.ggml.model") == "llama", field("tokenizer.ggml.model")
    return {
        "tokens": field("tokenizer.ggml.tokens"),
        "scores": field("tokenizer.ggml.scores"),
        "types": field("tokenizer.ggml.token_type"),
        "bos": field("tokenizer.ggml.bos_token_id"),
        "eos": field("tokenizer.ggml.eos_token_id"),
        "unk": field("tokenizer.ggml.unknown_token_id"),
        # llama.cpp and transformers default to BOS for a sentencepiece vocabulary.
        "add_bos": field("tokenizer.ggml.add_bos_token", True),
        "add_eos": field("tokenizer.ggml.add_eos_token", False),
    }


def sentencepiece_proto(v):
    """Llama-2's tokenizer.model, rebuilt from the GGUF's vocabulary."""
    P = pb.ModelProto.SentencePiece
    gguf_to_spm = {1: P.NORMAL, 2: P.UNKNOWN, 3: P.CONTROL, 4: P.USER_DEFINED, 5: P.UNUSED,
                   6: P.BYTE}
    m = pb.ModelProto()
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = len(v["tokens"])
    t.byte_fallback = True
    t.unk_id, t.bos_id, t.eos_id, t.pad_id = v["unk"], v["bos"], v["eos"], -1
    n = m.normalizer_spec
    n.name = "identity"
    n.add_dummy_prefix = True
    n.remove_extra_whitespaces = False
    n.escape_whitespaces = True
    for tok, score, ty in zip(v["tokens"], v["scores"], v["types"]):
        p = m.pieces.add()
        p.piece, p.score, p.type = tok, score, gguf_to_spm[ty]
    return m


def legacy_hf_tokenizer(proto, v):
    """transformers' legacy Llama tokenizer for this vocabulary (a `tokenizers.Tokenizer`)."""
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    vocab = {tok: i for i, tok in enumerate(v["tokens"])}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(v["tokens"], v["types"]) if ty in (2, 3)])
    bos = v["tokens"][v["bos"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, v["bos"])])
    return tok


def transformers_gguf_tokenizer(v):
    """transformers' GGUF tokenizer builder, fed the metadata as its reader would (the reader
    itself needs torch)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tok_dict = {"tokenizer_type": "llama", "pre_tokenizer_type": "default",
                "tokens": v["tokens"], "scores": v["scores"], "token_type": v["types"],
                "bos_token_id": v["bos"], "eos_token_id": v["eos"], "unk_token_id": v["unk"]}
    backend, _ = convert_gguf_tokenizer("llama", tok_dict)
    return backend


def split_special(text):
    """`text` cut at the special-token strings: [(is_special, piece)], leftmost-longest."""
    out, i, start = [], 0, 0
    while i < len(text):
        hit = next((s for s in sorted(SPECIAL_STRINGS, key=len, reverse=True)
                    if text.startswith(s, i)), None)
        if hit:
            if start < i:
                out.append((False, text[start:i]))
            out.append((True, hit))
            i += len(hit)
            start = i
        else:
            i += 1
    if start < len(text):
        out.append((False, text[start:]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=GGUF_PATH)
    ap.add_argument("--llama-cpp-vectors", metavar="DIR",
                    help="folder with llama.cpp's ggml-vocab-llama-spm.gguf.inp/.out")
    args = ap.parse_args()

    with open(args.gguf, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert digest == GGUF_SHA256, f"{args.gguf}: sha256 {digest}, expected {GGUF_SHA256}"
    v = read_vocab(args.gguf)
    assert v["add_bos"] and not v["add_eos"], (v["add_bos"], v["add_eos"])
    proto = sentencepiece_proto(v)
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    assert sp.get_piece_size() == len(v["tokens"]) == 32000
    hf = legacy_hf_tokenizer(proto, v)
    hf_gguf = transformers_gguf_tokenizer(v)
    bos = [v["bos"]]
    token_id = {t: i for i, t in enumerate(v["tokens"])}

    texts = list(EDGE_TEXTS)
    if args.llama_cpp_vectors:
        base = os.path.join(args.llama_cpp_vectors, "ggml-vocab-llama-spm.gguf")
        with open(base + ".inp", encoding="utf-8") as f:
            inp = f.read().split("\n__ggml_vocab_test__\n")
        with open(base + ".out", encoding="utf-8") as f:
            out = f.read().split("\n")
        # The file ends with a separator: its last piece is empty, and so is the matching line.
        assert inp[-1] == "" and out[len(inp) - 1] == "", "unexpected .inp/.out layout"
        inp = inp[:-1]
        for i, text in enumerate(inp):
            want = [int(x) for x in out[i].split()]
            got = sp.encode(text)
            assert got == want, f"llama.cpp vector {i} {text!r}: sentencepiece {got} != {want}"
        print(f"llama.cpp vectors: all {len(inp)} match the rebuilt sentencepiece model",
              file=sys.stderr)
        texts += [(f"llama_cpp_{i:02}", t) for i, t in enumerate(inp)]

    records, gguf_loader_diffs = [], []
    for name, text in texts:
        hf_enc = hf.encode(text, add_special_tokens=True).ids
        hf_dec = hf.decode(hf_enc, skip_special_tokens=True)
        if any(s in text for s in SPECIAL_STRINGS):
            # sentencepiece on each stretch between special tokens, as the legacy tokenizer does.
            seg = list(bos)
            for special, piece in split_special(text):
                seg += [token_id[piece]] if special else sp.encode(piece)
            assert seg == hf_enc, f"{name}: segmented sentencepiece {seg} != transformers {hf_enc}"
            ids, decoded, ref = hf_enc, hf_dec, "transformers-legacy"
        else:
            ids = bos + sp.encode(text)
            decoded = sp.decode(ids)
            assert hf_enc == ids, f"{name}: transformers {hf_enc} != sentencepiece {ids}"
            assert hf_dec == decoded, f"{name}: decode {hf_dec!r} != {decoded!r}"
            ref = "sentencepiece"
        # Its post-processor adds no BOS (transformers adds it from tokenizer_config).
        if bos + hf_gguf.encode(text, add_special_tokens=False).ids != ids:
            gguf_loader_diffs.append(name)
        records.append({"name": name, "text": text, "reference": ref, "ids": ids,
                        "decoded": decoded})

    canon = {}
    for name, text in sorted(canonical.canonical_texts().items()):
        ids = bos + sp.encode(text)
        hf_ids = hf.encode(text, add_special_tokens=True).ids
        assert hf_ids == ids, f"{name}: transformers and sentencepiece disagree"
        decoded = sp.decode(ids)
        canon[name] = {
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "n_ids": len(ids),
            "ids_sha256": sha256_ids(ids),
            "chunk": CHUNK,
            "chunk_sha256": [sha256_ids(ids[i:i + CHUNK]) for i in range(0, len(ids), CHUNK)],
            "head": ids[:64],
            "tail": ids[-64:],
            "decoded_sha256": hashlib.sha256(decoded.encode("utf-8")).hexdigest(),
            "decoded_equals_text": decoded == text,
        }
        print(f"{name:18} {len(text):>8} chars -> {len(ids):>8} ids, decode round-trips: "
              f"{decoded == text}", file=sys.stderr)

    fixture = {
        "about": "Reference ids for the Llama-2 SentencePiece vocabulary in "
                 "ggml-vocab-llama-spm.gguf; made by scripts/golden/make_spm_fixtures.py.",
        "gguf": "tests/fixtures/ggml-vocab-llama-spm.gguf",
        "gguf_sha256": digest,
        "gguf_origin": "llama-cpp-python 0.3.36 sdist (PyPI), "
                       "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf",
        "versions": {p: version(p) for p in
                     ("sentencepiece", "gguf", "transformers", "tokenizers", "protobuf")},
        "llama_cpp_vectors_checked": bool(args.llama_cpp_vectors),
        "add_bos": True,
        "bos_id": v["bos"],
        "texts": records,
        "canonical": canon,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(fixture, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {OUT}: {len(records)} texts + {len(canon)} canonical texts", file=sys.stderr)
    print(f"transformers' GGUF loader (non-legacy) differs on {len(gguf_loader_diffs)} texts: "
          f"{gguf_loader_diffs}", file=sys.stderr)


if __name__ == "__main__":
    main()
