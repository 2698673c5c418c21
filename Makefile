# StrataFlux developer entry points. `make test` is what CI runs (via .ci/run).
SHELL := /bin/bash
SFX_ASSETS ?= $(CURDIR)/assets
export SFX_ASSETS
CARGO ?= cargo
MODEL := $(SFX_ASSETS)/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: all build assets test fmt-check clippy unit demo eval golden clean

all: build

build:
	$(CARGO) build --release

assets:
	bash scripts/fetch_assets.sh

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Unit and integration tests; integration tests run the real SmolLM2 model and texts.
unit: assets
	mkdir -p target; set -o pipefail; $(CARGO) test --workspace 2>&1 | tee target/test.log
	@awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($$(i+1) ~ /^passed/) p += $$i; if ($$(i+1) ~ /^failed/) f += $$i } } \
	     END { printf "tests: %d passed, %d failed\n", p, f; exit (f > 0 || p == 0) }' target/test.log

test: fmt-check clippy unit

# The README's demo: fetch the model, import it, and chat with it.
demo: assets build
	./target/release/sfx-run $(MODEL) --chat -p "What is the capital of France? Answer in one sentence." -n 48

# Reference evaluation numbers recorded in docs/results.md.
eval: assets build
	./target/release/sfx-run $(MODEL) --ppl wiki:8 --json
	./target/release/sfx-run $(MODEL) --ppl austen-long:2048 --json

# Regenerate the independent transformers fixtures (needs the venv in scripts/golden/README.md).
golden: assets
	python scripts/golden/make_golden.py
	python scripts/golden/eval_ppl.py

clean:
	$(CARGO) clean
