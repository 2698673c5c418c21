#!/usr/bin/env python3
"""Independent builders of the canonical evaluation texts (as defined below; docs/method.md §7).

- wiki: entries of summaries_en-us.json sorted by JSON key in Unicode code point order, each
  entry's `extract` stripped of surrounding whitespace (Python str.strip()), joined with "\n\n",
  plus a final "\n".
- austen/<name>: the novel's lines (an R character vector in the janeaustenr lazy-load DB) joined
  with "\n", NA -> "", plus a final "\n".

The R reader below is self-contained (gzip/zlib + a minimal XDR unserializer for the few SEXP
types the lazy-load index and the character vectors use); when the `rdata` package is installed
it is used as a cross-check.

Run as a script to write tests/fixtures/canonical_texts.json ({name: {chars, bytes, sha256}}).
"""
import gzip
import hashlib
import json
import os
import struct
import sys
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.environ.get("SFX_ASSETS", os.path.join(REPO, "assets"))

AUSTEN_NOVELS = ["emma", "mansfieldpark", "prideprejudice", "sensesensibility", "persuasion",
                 "northangerabbey"]


# ---------------------------------------------------------------------------------------------
# wiki
def wiki_text(assets=ASSETS):
    with open(os.path.join(assets, "wiki", "summaries_en-us.json"), "rb") as f:
        data = json.loads(f.read().decode("utf-8"))
    assert isinstance(data, dict)
    # Python compares str by code point, which is exactly "Unicode code point order".
    keys = sorted(data.keys())
    parts = []
    for k in keys:
        entry = data[k]
        extract = entry["extract"] if isinstance(entry, dict) else entry
        parts.append(extract.strip())
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------
# Minimal R XDR unserializer (format version 2 or 3).
class _RReader:
    NILVALUE_SXP = 254
    NILSXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 0, 1, 2, 9, 10, 13, 14, 16, 19

    def __init__(self, buf):
        assert buf[:2] == b"X\n", "only XDR ('X\\n') serialization is supported"
        self.b = buf
        self.p = 2
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.native_encoding = self.b[self.p:self.p + n].decode("ascii")
            self.p += n
        else:
            assert version == 2, version
        self.refs = []

    def int(self):
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def read(self):
        flags = self.int()
        t = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if t == self.NILVALUE_SXP:
            return None
        if t == 255:  # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == self.SYMSXP:
            name = self.read()  # CHARSXP
            sym = ("sym", name)
            self.refs.append(sym)
            return sym
        if t == self.LISTSXP:
            attr = self.read() if has_attr else None
            tag = self.read() if has_tag else None
            car = self.read()
            cdr = self.read()
            out = [(tag[1] if tag else None, car)]
            if cdr is not None:
                out.extend(cdr)
            return out
        if t == self.CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = self.b[self.p:self.p + n]
            self.p += n
            if levels & (1 << 2):  # LATIN1_MASK
                return raw.decode("latin-1")
            # UTF8_MASK, ASCII_MASK or native (UTF-8 here)
            return raw.decode("utf-8")
        if t in (self.LGLSXP, self.INTSXP):
            n = self.int()
            vals = list(struct.unpack_from(">%di" % n, self.b, self.p))
            self.p += 4 * n
            res = vals
        elif t == self.REALSXP:
            n = self.int()
            vals = list(struct.unpack_from(">%dd" % n, self.b, self.p))
            self.p += 8 * n
            res = vals
        elif t == self.STRSXP:
            n = self.int()
            res = [self.read() for _ in range(n)]
        elif t == self.VECSXP:
            n = self.int()
            res = [self.read() for _ in range(n)]
        else:
            raise NotImplementedError("SEXP type %d" % t)
        if has_attr:
            attrs = dict(self.read())
            names = attrs.get("names")
            if names is not None and t == self.VECSXP:
                return dict(zip(names, res))
            if names is not None and t == self.INTSXP:
                return dict(zip(names, res))
        return res


def _r_unserialize(buf):
    return _RReader(buf).read()


def austen_index(assets=ASSETS):
    rdx = gzip.decompress(open(os.path.join(assets, "austen", "Rdata.rdx"), "rb").read())
    idx = _r_unserialize(rdx)
    return idx["variables"]  # name -> [offset, length]


def austen_lines(name, assets=ASSETS):
    off, length = austen_index(assets)[name]
    with open(os.path.join(assets, "austen", "Rdata.rdb"), "rb") as f:
        f.seek(off)
        blob = f.read(length)
    (ulen,) = struct.unpack(">I", blob[:4])
    raw = zlib.decompress(blob[4:])
    assert len(raw) == ulen, (len(raw), ulen)
    lines = _r_unserialize(raw)
    assert isinstance(lines, list) and all(x is None or isinstance(x, str) for x in lines)
    return lines


def austen_text(name, assets=ASSETS):
    return "\n".join("" if l is None else l for l in austen_lines(name, assets)) + "\n"


def _crosscheck_with_rdata(name, lines, assets=ASSETS):
    try:
        import rdata  # noqa: F401
    except ImportError:
        return None
    import warnings
    off, length = austen_index(assets)[name]
    with open(os.path.join(assets, "austen", "Rdata.rdb"), "rb") as f:
        f.seek(off)
        blob = f.read(length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = rdata.parser.parse_data(zlib.decompress(blob[4:]))
        arr = rdata.conversion.convert(parsed)
    theirs = [None if (x is None or (not isinstance(x, str))) else str(x) for x in list(arr)]
    assert theirs == lines, "rdata cross-check failed for " + name
    return True


# ---------------------------------------------------------------------------------------------
def canonical_texts(assets=ASSETS):
    out = {"wiki": wiki_text(assets)}
    for n in AUSTEN_NOVELS:
        out[n] = austen_text(n, assets)
    return out


def describe(text):
    b = text.encode("utf-8")
    return {"chars": len(text), "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}


def main():
    texts = canonical_texts()
    for n in AUSTEN_NOVELS:
        ok = _crosscheck_with_rdata(n, austen_lines(n))
        if ok:
            print("rdata cross-check ok:", n, file=sys.stderr)
    res = {name: describe(t) for name, t in texts.items()}
    for name, d in res.items():
        print("%-18s chars=%-9d bytes=%-9d sha256=%s" % (name, d["chars"], d["bytes"], d["sha256"]))
    path = os.path.join(REPO, "tests", "fixtures", "canonical_texts.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
