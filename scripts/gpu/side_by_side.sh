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
#     quant      llama.cpp Q2_K / Q4_K_M / Q4_0 vs sfx rtn2 / rtn3 / rtn4 (BF16 and q4 heads)
#     head       quantized heads: the head-ops conformance, SmolLM2 CUDA-vs-CPU agreement of
#                coded-head .sfx files, and llama.cpp Q2_K / Q4_0 / Q4_K_M vs sfx rtn2 / rtn4
#                with q4 / q6 / q8 heads (llama.cpp's own Q2_K keeps a Q6_K head)
#     all        one call for everything that needs the peer: prepare, the full conformance
#                suite while llama.cpp builds (FALLBACK=dir: binaries benched instead if it
#                fails), then quant and f16
#     group      sfx only: group-code conformance, rtn2/3/4 bench, file-layout rows sweep, and
#                an ncu profile of one rtn2 decode step (per-kernel time, bandwidth, stalls)
#     plans      sfx only: the tile matvecs' conformance under forced plans
#                (SFX_GT_PLAN=tiles,stages[,sets[,warps]], so every kernel variant, the
#                sequential sets and the 16-warp blocks run), then per-kernel decode time of
#                rtn2 and rtn4 under each plan (SFX_PROFILE_KERNELS=1, step graphs off) and
#                tg128 (graphs on)
#     trellis    sfx only: the trellis (QTIP/YAQA) conformance ops and the whole-model decode
#                cases (OPS=… to choose), tg128/pp512 of trellis formats on the 8B shape beside
#                rtn2 (FORMATS="qtip2:hyb qtip2:1mad …"), per-kernel decode times of qtip2, the
#                tile-rows knob (SFX_TR_ROWS) and an ncu profile of one layer's four matvecs
#     trellis_peer  the trellis conformance ops while llama.cpp builds, then llama.cpp Q2_K /
#                Q4_K_M / Q4_0 and every sfx 2/3/4-bit format (FORMATS="rtn2 … qtip2:1mad …")
#                back to back on a quiet machine, and qtip2's per-kernel decode times
#   BIN=dir with sfx, sfx-run, sfx-convert, cuda_agreement (release builds with kernels:
#       `make build-gpu`, `cargo test --release --test cuda_agreement --no-run`)
#   SFX_ASSETS=dir with SmolLM2-135M-Instruct.Q4_1.gguf, wiki/ and brown/ (`make assets`)
#   PEER=the llama.cpp kit (shared peers/llamacpp/prepare.sh; its device_bench.sh)
#   OUT=where results go (default ./gpu-out)
#   CASES=a test-name filter for the agreement stage (e.g. smollm2_sfx::rtn2)
# The lent H200 takes at most 64 MiB per call, so the measured runs carried the GGUF in two
# halves over consecutive calls; the stages are the commands those calls ran.
set -u
STAGE="${1:?stage: prepare, conformance, agreement, f16, quant, head, all, group, plans, trellis or trellis_peer}"
BIN="${BIN:?set BIN}"; PEER="${PEER:?set PEER}"
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
BENCH_ARGS="-p 512 -n 128 -r 3"
case "$STAGE" in
  prepare)
    # llama-bench builds (~3.5 min) and the GGUFs are written while other stages run; no
    # benchmark starts (DEADLINE=0), so nothing competes with a timed run. Once per machine:
    # a preparation already under way is left to finish.
    pgrep -f device_bench.sh >/dev/null ||
      setsid bash -c "QUANTS='${PEER_QUANTS:-f16 q2_k q4_k_m q4_0}' DEADLINE=0 OUT=/tmp/peerprep bash '$PEER/device_bench.sh'" \
        >/tmp/peerprep.log 2>&1 </dev/null &
    ;;
  conformance)
    "$BIN/sfx" test-backend --device cuda > "$OUT/test_backend_cuda.md" 2>&1; grep "cases on cuda" "$OUT/test_backend_cuda.md"
    ;;
  agreement)
    : "${SFX_ASSETS:?set SFX_ASSETS}"
    G="$SFX_ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
    # Each .sfx case converts SmolLM2 on the device first (~1-2 min with its refinement
    # statistics): the log is kept as it goes, so a call's time limit loses no finished case.
    SFX_REPO="$REPO" SFX_AGREEMENT_OUT="$OUT" SFX_CONVERT="$BIN/sfx-convert" "$BIN/cuda_agreement" ${CASES:-} 2>&1 \
      | tee "$OUT/cuda_agreement.log" | tail -12
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
      for head in bf16 q4; do
        "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant "$q" --head $head $BENCH_ARGS
      done
    done > "$OUT/sfx_bench_group.md"
    cat "$OUT/llamacpp_bench.md" "$OUT/sfx_bench_group.md"
    ;;
  group)
    # Tensor-core tile layout (default on sm_80+) and the file layout's CUDA-core kernels.
    for tiles in 1 0; do
      for op in group_linear group_projections group_swiglu; do
        SFX_GROUP_TILES=$tiles "$BIN/sfx" test-backend --device cuda --op $op > "$OUT/test_backend_${op}_tiles$tiles.md" 2>&1
        echo "tiles=$tiles $(grep "cases on cuda" "$OUT/test_backend_${op}_tiles$tiles.md")"
      done
    done
    for q in rtn2 rtn3 rtn4; do
      "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant "$q" $BENCH_ARGS
    done > "$OUT/sfx_bench_group.md"
    for q in rtn2 rtn4; do
      echo "SFX_GROUP_TILES=0 $q"
      SFX_GROUP_TILES=0 "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant $q -p 0 -n 128 -r 3
    done > "$OUT/sfx_bench_group_rows_layout.md"
    for r in 1 2 4; do  # rows per thread of the file-layout kernels (the tile plans: stage plans)
      echo "SFX_GROUP_TILES=0 SFX_GROUP_ROWS=$r"
      SFX_GROUP_TILES=0 SFX_GROUP_ROWS=$r "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant rtn2 -p 0 -n 128 -r 3
    done > "$OUT/sfx_bench_group_rows.md"
    cat "$OUT/sfx_bench_group.md" "$OUT/sfx_bench_group_rows_layout.md" "$OUT/sfx_bench_group_rows.md"
    # One decode step's kernels (graphs off: ncu replays each kernel; durations are the same).
    DECODE='regex:gq_|gt_|rope|attn|write_kv|matvec|argmax|rms_norm|silu|add_assign|embedding'
    ncu --clock-control none --kernel-name "$DECODE" --launch-skip 800 --launch-count 330 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_elapsed,launch__registers_per_thread,launch__grid_size \
      --csv "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant rtn2 -p 0 -n 8 -r 1 --graphs off \
      > "$OUT/ncu_rtn2_step.csv" 2> "$OUT/ncu_rtn2_step.err"
    python3 "$REPO/scripts/gpu/ncu_summary.py" "$OUT/ncu_rtn2_step.csv" > "$OUT/ncu_rtn2_step_summary.md"
    for k in gt_swiglu_norm gt_matvec_norm 'gt_matvec_b2_r1_s3$' attn_decode; do
      ncu --clock-control none --kernel-name "regex:$k" --launch-skip 70 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats \
        "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant rtn2 -p 0 -n 8 -r 1 --graphs off
    done > "$OUT/ncu_rtn2_sections.txt" 2>&1
    ;;
  plans)
    PLANS="${PLANS:-1,3 1,4 2,3 2,4 4,3 4,4}"
    for plan in 1,3 2,4 4,4 1,3,2 1,3,3 1,3,2,16; do
      for op in group_linear group_projections group_swiglu; do
        SFX_GT_PLAN=$plan "$BIN/sfx" test-backend --device cuda --op $op > "$OUT/test_backend_${op}_plan${plan//,/_}.md" 2>&1
        echo "plan=$plan $(grep "cases on cuda" "$OUT/test_backend_${op}_plan${plan//,/_}.md")"
      done
    done
    for q in rtn2 rtn4; do
      for plan in default $PLANS; do
        f="$OUT/plan_${q}_${plan//,/_}"
        env $([ "$plan" = default ] || echo SFX_GT_PLAN=$plan) SFX_PROFILE_KERNELS=1 \
          "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant $q -p 0 -n 32 -r 1 --graphs off \
          > "$f.md" 2> "$f.err"
        env $([ "$plan" = default ] || echo SFX_GT_PLAN=$plan) \
          "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant $q -p 0 -n 128 -r 2 >> "$f.md" 2>/dev/null
        echo "$q plan=$plan $(grep -o 'tg[0-9]* | [0-9.]*' "$f.md" | tr '\n' ' ')"
        grep -E '^\| gt_' "$f.err" | awk -F'|' '{printf "  %s %s %s\n", $2, $3, $6}'
      done
    done
    ;;
  head)
    for op in group_embedding group_linear; do
      "$BIN/sfx" test-backend --device cuda --op $op > "$OUT/test_backend_${op}.md" 2>&1
      echo "$op: $(grep "cases on cuda" "$OUT/test_backend_${op}.md")"
    done
    : "${SFX_ASSETS:?set SFX_ASSETS}"
    SFX_REPO="$REPO" SFX_AGREEMENT_OUT="$OUT" SFX_CONVERT="$BIN/sfx-convert" "$BIN/cuda_agreement" "${CASES:-_head_}" 2>&1 \
      | tee "$OUT/cuda_agreement_head.log" | tail -6
    while pgrep -f device_bench.sh >/dev/null; do sleep 5; done
    QUANTS="q2_k q4_k_m q4_0" ARGS="$BENCH_ARGS -fa 1" DEADLINE=600 OUT="$OUT" bash "$PEER/device_bench.sh" >/dev/null
    for q in rtn2 rtn4; do
      for head in bf16 q4 q6 q8; do
        "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant "$q" --head $head $BENCH_ARGS
      done
    done > "$OUT/sfx_bench_heads.md"
    cat "$OUT/llamacpp_bench.md" "$OUT/sfx_bench_heads.md"
    ;;
  trellis)
    for op in ${OPS:-trellis_linear trellis_projections trellis_swiglu model_decode}; do
      "$BIN/sfx" test-backend --device cuda --op $op > "$OUT/test_backend_$op.md" 2>&1
      echo "$op: $(grep "cases on cuda" "$OUT/test_backend_$op.md")"
      grep -E '^\| ' "$OUT/test_backend_$op.md" | grep -v -E '\| ok \||^\| op|^\| ---' | head -12
    done
    for f in ${FORMATS:-qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb rtn2:hyb}; do
      timeout 300 "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant "${f%%:*}" --trellis-code "${f##*:}" $BENCH_ARGS 2>&1 | grep -E 'synthetic|rror'
    done | tee "$OUT/sfx_bench_trellis.md"
    SFX_PROFILE_KERNELS=1 timeout 300 "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 16 -r 1 --graphs off \
      > "$OUT/profile_qtip2.md" 2> "$OUT/profile_qtip2.err"
    grep -E '^\| ' "$OUT/profile_qtip2.err" | head -24
    SFX_TR_ROWS=2 timeout 300 "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 128 -r 2 2>&1 | grep -E 'synthetic|rror' | sed 's/^/SFX_TR_ROWS=2 /'
    # One layer's four matvecs (q/k/v, o, gate/up, down) under ncu: what bounds them.
    timeout 240 ncu --clock-control none --kernel-name regex:tr_matvec --launch-skip 40 --launch-count 4 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section MemoryWorkloadAnalysis \
      "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 4 -r 1 --graphs off \
      > "$OUT/ncu_trellis_matvec.txt" 2>&1
    grep -E 'tr_matvec|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Warp|No Eligible|Stall|Block Limit' "$OUT/ncu_trellis_matvec.txt" | head -60
    ;;
  trellis_peer)
    # One call: llama.cpp builds in the background while the trellis conformance runs; then,
    # on a quiet machine, its Q2_K / Q4_K_M / Q4_0 rows and ours (every 2/3/4-bit format the
    # converter writes, default head) back to back, and the per-kernel profile of qtip2.
    PEER_QUANTS="q2_k q4_k_m q4_0" bash "$0" prepare
    for op in ${OPS:-trellis_linear trellis_projections trellis_swiglu model_decode}; do
      "$BIN/sfx" test-backend --device cuda --op $op > "$OUT/test_backend_$op.md" 2>&1
      echo "$op: $(grep "cases on cuda" "$OUT/test_backend_$op.md")"
    done
    while pgrep -f device_bench.sh >/dev/null; do sleep 5; done
    QUANTS="q2_k q4_k_m q4_0" ARGS="$BENCH_ARGS -fa 1" DEADLINE=600 OUT="$OUT" bash "$PEER/device_bench.sh" >/dev/null
    cat "$OUT/llamacpp_bench.md"
    for f in ${FORMATS:-rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip2:3inst qtip3:hyb qtip4:hyb}; do
      code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
      timeout 300 "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant "${f%%:*}" "${code[@]}" $BENCH_ARGS 2>&1 | grep -E 'synthetic|rror'
    done | tee "$OUT/sfx_bench_formats.md"
    SFX_PROFILE_KERNELS=1 timeout 300 "$BIN/sfx" bench --synthetic llama-3.1-8b --device cuda --quant qtip2 -p 0 -n 16 -r 1 --graphs off \
      > "$OUT/profile_qtip2.md" 2> "$OUT/profile_qtip2.err"
    grep -E '^\| ' "$OUT/profile_qtip2.err" | head -14
    ;;
  all)
    bash "$0" prepare
    "$BIN/sfx" test-backend --device cuda > "$OUT/test_backend_cuda.md" 2>&1
    grep "cases on cuda" "$OUT/test_backend_cuda.md"
    if ! grep -q "cases on cuda.* 0 failed" "$OUT/test_backend_cuda.md"; then
      grep -v "| ok |" "$OUT/test_backend_cuda.md" | tail -20
      BIN="${FALLBACK:?conformance failed and no FALLBACK binaries}"; echo "benching FALLBACK $BIN"
    fi
    BIN="$BIN" bash "$0" quant
    BIN="$BIN" bash "$0" f16
    ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
