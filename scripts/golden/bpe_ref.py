"""Independent pure-Python byte-level BPE (GGUF tokens + merges, "smollm" pre-tokenizer: isolate
\p{N}, then the GPT-2 regex), compared with the patched transformers tokenizer on the golden
prompts and all canonical texts. Needs no transformers for encode(); prints name, counts, equal."""
import sys, os, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import regex, gguf, texts, common
r = gguf.GGUFReader(common.GGUF_PATH)
tokens = r.fields["tokenizer.ggml.tokens"].contents()
merges = r.fields["tokenizer.ggml.merges"].contents()
vocab = {t: i for i, t in enumerate(tokens)}
rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
def b2u():
    bs = list(range(ord("!"), ord("~")+1)) + list(range(ord("¡"), ord("¬")+1)) + list(range(ord("®"), ord("ÿ")+1))
    cs = bs[:]; n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256+n); n += 1
    return dict(zip(bs, map(chr, cs)))
B = b2u()
GPT2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
DIG = regex.compile(r"\p{N}")
cache = {}
def bpe(word):
    if word in cache: return cache[word]
    parts = list(word)
    while len(parts) > 1:
        best = None
        for i in range(len(parts)-1):
            rk = rank.get((parts[i], parts[i+1]))
            if rk is not None and (best is None or rk < best[0]): best = (rk, i)
        if best is None: break
        i = best[1]; parts[i:i+2] = [parts[i] + parts[i+1]]
    ids = [vocab[p] for p in parts]
    cache[word] = ids
    return ids
def pieces(text):
    pos = 0
    for m in DIG.finditer(text):
        if m.start() > pos: yield text[pos:m.start()]
        yield m.group(); pos = m.end()
    if pos < len(text): yield text[pos:]
def encode(text):
    out = []
    for seg in pieces(text):
        for w in GPT2.findall(seg):
            out += bpe("".join(B[b] for b in w.encode("utf-8")))
    return out
tok = common.load_tokenizer()
T = texts.canonical_texts()
import json
g = json.load(open(os.path.join(common.FIXTURES, "golden_smollm2.json")))
for p in g["prompts"]:
    if p["name"] != "chat":
        print(p["name"], encode(p["text"]) == p["ids"])
for name, t in T.items():
    t0 = time.time(); a = encode(t); b = tok(t, add_special_tokens=False).input_ids
    print(name, len(a), len(b), a == b, round(time.time()-t0, 1))
