#!/usr/bin/env bash
# Runs on a CUDA machine: StrataFlux's conformance suite, the SmolLM2 CUDA-vs-CPU agreement
# (float model and converted .sfx files), and llama.cpp's llama-bench beside `sfx bench` on the
# synthetic Llama-3.1-8B shape, each pair in one command. The numbers in docs/results.md
# ("CUDA backend", "Group codes on CUDA") come from it.
#
#   bash scripts/gpu/side_by_side.sh STAGE   with STAGE one of
#     prepare    start building llama-bench and writing its GGUFs in the background
#     conformance  sfx test-backend --device cuda
#     agreement  SmolLM2 CUDA vs CPU (float, rtn3 and awq3 .sfx), wiki:2 PPL/KL through sfx-run
#     f16        llama.cpp F16 vs sfx BF16 at depths 0, 4096, 32768 (step graphs on and off)
#     quant      llama.cpp Q2_K / Q4_K_M / Q4_0 vs sfx rtn2 / rtn3 / rtn4 (BF16 head)
#   BIN=dir with sfx, sfx-run, sfx-convert, cuda_agreement (release builds with kernels:
#       `make build-gpu`, `cargo test --release --test cuda_agreement --no-run`)
#   SFX_ASSETS=dir with SmolLM2-135M-Instruct.Q4_1.gguf, wiki/ and brown/ (`make assets`)
#   PEER=the llama.cpp kit (shared peers/llamacpp/prepare.sh; its device_bench.sh)
#   OUT=where results go (default ./gpu-out)
# The lent H200 takes at most 64 MiB per call, so the measured runs carried the GGUF in two
# halves over consecutive calls; the stages are the commands those calls ran.
set -u
STAGE="${1:?stage: prepare, conformance, agreement, f16 or quant}"
BIN="${BIN:?set BIN}"; PEER="${PEER:?set PEER}"
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
BENCH_ARGS="-p 512 -n 128 -r 3"
case "$STAGE" in
  prepare)
    # llama-bench builds (~3.5 min) and the GGUFs are written while other stages run; no
    # benchmark starts (DEADLINE=0), so nothing competes with a timed run.
    setsid bash -c "QUANTS='f16 q2_k q4_k_m q4_0' DEADLINE=0 OUT=/tmp/peerprep bash '$PEER/device_bench.sh'" \
      >/tmp/peerprep.log 2>&1 </dev/null &
    ;;
  conformance)
    "$BIN/sfx" test-backend --device cuda > "$OUT/test_backend_cuda.md"; tail -1 "$OUT/test_backend_cuda.md"
    ;;
  agreement)
    : "${SFX_ASSETS:?set SFX_ASSETS}"
    G="$SFX_ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
    SFX_REPO="$REPO" SFX_AGREEMENT_OUT="$OUT" SFX_CONVERT="$BIN/sfx-convert" "$BIN/cuda_agreement" 2>&1 | tail -12
    "$BIN/sfx-run" "$G" --ppl wiki:2 --device cuda --kl-ref "$G" --kl-ref-device cpu --json > "$OUT/ppl_cuda_vs_cpu.json"
    ;;
  f16)
    while pgrep -f device_bench.sh >/dev/null; do sleep 5; done  # the prepare stage
    QUANTS=f16 ARGS="$BENCH_ARGS -fa 1 -d 0,4096,32768" DEADLINE=600 OUT="$OUT" bash "$PEER/device_bench.sh" >/dev/null
    "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda $BENCH_ARGS -d 0,4096,32768 --graphs both > "$OUT/sfx_bench_bf16.md"
    cat "$OUT/llamacpp_bench.md" "$OUT/sfx_bench_bf16.md"
    ;;
  quant)
    while pgrep -f device_bench.sh >/dev/null; do sleep 5; done
    QUANTS="q2_k q4_k_m q4_0" ARGS="$BENCH_ARGS -fa 1" DEADLINE=600 OUT="$OUT" bash "$PEER/device_bench.sh" >/dev/null
    for q in rtn2 rtn3 rtn4; do
      "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant "$q" $BENCH_ARGS
    done > "$OUT/sfx_bench_group.md"
    # Programmatic dependent launch (off by default) against the default, BF16 decode.
    for pdl in 0 1; do
      SFX_PDL=$pdl "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda -p 0 -n 128 -r 3
    done > "$OUT/sfx_bench_pdl.md"
    cat "$OUT/llamacpp_bench.md" "$OUT/sfx_bench_group.md" "$OUT/sfx_bench_pdl.md"
    ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
