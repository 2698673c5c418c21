# StrataFlux developer entry points. `make test` is what CI runs (via .ci/run).
SHELL := /bin/bash
SFX_ASSETS ?= $(CURDIR)/assets
export SFX_ASSETS
CARGO ?= cargo
MODEL := $(SFX_ASSETS)/SmolLM2-135M-Instruct.Q4_1.gguf

# The CUDA kernels compile with the pinned nvcc from PyPI (scripts/fetch_cuda_tools.sh); with
# SFX_NVCC set, a kernel that does not compile fails the build. `make build` without it still
# works (CPU only; the CUDA backend then says the binary has no kernels).
NVCC_PATH := $(CURDIR)/.cache/cuda-tools/nvidia/cu13/bin/nvcc

.PHONY: all build build-gpu cuda-tools assets hub-client test fmt-check clippy unit demo eval golden clean

all: build

build:
	$(CARGO) build --release

# The binary with embedded CUDA kernels (runs on CPU-only machines too).
build-gpu: cuda-tools
	SFX_NVCC=$(NVCC_PATH) $(CARGO) build --release

cuda-tools:
	bash scripts/fetch_cuda_tools.sh >/dev/null

assets:
	bash scripts/fetch_assets.sh

# The Hugging Face Hub client `sfx publish` uploads with (`hf upload`), in a venv
# of its own (system Pythons refuse pip installs: PEP 668). `sfx publish` finds it through
# SFX_HF_CLI=.cache/hub-client/bin/hf or PATH.
hub-client:
	python3 -m venv .cache/hub-client
	.cache/hub-client/bin/python -m pip install -q --upgrade huggingface_hub
	@echo "hub client: .cache/hub-client/bin/hf (export SFX_HF_CLI=.cache/hub-client/bin/hf)"

fmt-check:
	$(CARGO) fmt --all -- --check

clippy: cuda-tools
	SFX_NVCC=$(NVCC_PATH) $(CARGO) clippy --workspace --all-targets -- -D warnings

# `make test` lints while it builds: clippy-driver is the workspace crates' compiler (cargo's
# RUSTC_WORKSPACE_WRAPPER, what `cargo clippy` itself sets) with warnings denied, so the test
# build reports what `make clippy` would, for every target `--all-targets` checks. A separate
# `cargo clippy` first built every dependency again in check mode, sharing nothing with the test
# build: 455 s of a 2-core CI run. CLIPPY_ARGS is how cargo clippy hands its `-- -D warnings` to
# the driver; dependencies are compiled by rustc as before, so their builds are shared with
# plain `cargo test`.
CLIPPY_DRIVER ?= $(shell rustup which clippy-driver 2>/dev/null || command -v clippy-driver)
LINTED_BUILD := RUSTC_WORKSPACE_WRAPPER=$(CLIPPY_DRIVER) CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__

# Unit and integration tests; integration tests run the real SmolLM2 model and texts. CUDA
# cases are reported as ignored (by name) on a machine without a GPU. `make unit` leaves the
# examples (benchmarks) out: linking their ten binaries at the tests' opt-level costs a minute
# for nothing they run; `make test` builds them to lint them. The doc tests run apart.
UNIT_TARGETS ?= --lib --bins --tests
unit: assets cuda-tools
	mkdir -p target; set -o pipefail; $(UNIT_ENV) SFX_NVCC=$(NVCC_PATH) $(CARGO) test --workspace $(UNIT_TARGETS) 2>&1 | tee target/test.log
	set -o pipefail; $(UNIT_ENV) SFX_NVCC=$(NVCC_PATH) $(CARGO) test --workspace --doc 2>&1 | tee -a target/test.log
	@awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($$(i+1) ~ /^passed/) p += $$i; if ($$(i+1) ~ /^failed/) f += $$i } } \
	     END { printf "tests: %d passed, %d failed\n", p, f; exit (f > 0 || p == 0) }' target/test.log
	@grep -E '^test cuda(-branches)?::.* ignored$$' target/test.log | wc -l | xargs -I{} echo "skipped without a GPU: {} cuda:: and cuda-branches:: cases (listed as ignored above)"

test: fmt-check cuda-tools
	@test -n "$(CLIPPY_DRIVER)" || { echo "make test: clippy-driver not found (rustup component add clippy)"; exit 1; }
	$(MAKE) unit UNIT_ENV="$(LINTED_BUILD)" UNIT_TARGETS="--lib --bins --tests --examples"

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
