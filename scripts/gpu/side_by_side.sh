#!/usr/bin/env bash
# Runs on a CUDA machine: StrataFlux's conformance suite, the SmolLM2 CUDA-vs-CPU agreement, and
# llama.cpp's llama-bench (F16) and `sfx bench` (BF16) on the synthetic Llama-3.1-8B shape, side
# by side in one command. The numbers in docs/results.md ("CUDA backend") come from it.
#
#   BIN=dir with sfx, sfx-run, cuda_agreement (release builds with kernels: `make build-gpu`,
#       `cargo test --release --test cuda_agreement --no-run`)
#   SFX_ASSETS=dir with SmolLM2-135M-Instruct.Q4_1.gguf and wiki/ (`make assets`)
#   PEER=the llama.cpp kit made by shared peers/llamacpp/prepare.sh (its device_bench.sh)
#   OUT=where results go (default ./gpu-out)
# The lent H200 takes at most 64 MiB per call, so the measured run split this in two calls
# (first half of the GGUF + starting the llama.cpp build, then the rest); the commands are these.
set -u
BIN="${BIN:?set BIN}"; PEER="${PEER:?set PEER}"; : "${SFX_ASSETS:?set SFX_ASSETS}"
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
G="$SFX_ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
export SFX_REPO="$REPO" SFX_AGREEMENT_OUT="$OUT"
"$BIN/sfx" test-backend --device cuda > "$OUT/test_backend_cuda.md"; tail -1 "$OUT/test_backend_cuda.md"
"$BIN/cuda_agreement" | tail -6
"$BIN/sfx-run" "$G" --ppl wiki:2 --device cuda --kl-ref "$G" --kl-ref-device cpu --json > "$OUT/ppl_cuda_vs_cpu.json"
QUANTS=f16 ARGS="-p 512 -n 128 -r 3 -fa 1 -d 0,4096,32768" DEADLINE=600 OUT="$OUT" bash "$PEER/device_bench.sh"
"$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda -p 512 -n 128 -r 3 -d 0,4096,32768 --graphs both | tee "$OUT/sfx_bench_bf16.md"
