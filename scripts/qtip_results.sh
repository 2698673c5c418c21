#!/usr/bin/env bash
# Issue 6 table (docs/results.md, "Trellis resident bases"): convert the float model to each
# resident base with fitted refinement, then evaluate PPL and KL on wiki:8 with the base alone
# and with the fitted refinement, side by side in one sfx-run call per model.
#
#   QUANTS="rtn2 awq2 qtip2 yaqa2" OUT=results/qtip bash scripts/qtip_results.sh
#
# Env: SFX_BIN (folder with sfx-convert / sfx-run, default target/release), SRC (float model,
# default the pinned GGUF), OUT (output folder), QUANTS, EXTRA (more sfx-convert flags),
# EVAL (PPL spec, default wiki:8), SFX_DIR (where the .sfx files go, default OUT), KEEP=0
# deletes each .sfx after its evaluation, TAR=file.tgz packs OUT's logs after every model.
set -euo pipefail
SFX_BIN=${SFX_BIN:-target/release}
SRC=${SRC:-${SFX_ASSETS:-assets}/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-results/qtip}
QUANTS=${QUANTS:-"rtn2 awq2 qtip2 yaqa2"}
EVAL=${EVAL:-wiki:8}
KEEP=${KEEP:-1}
SFX_DIR=${SFX_DIR:-$OUT}
mkdir -p "$OUT" "$SFX_DIR"

# Peak RSS of a child: GNU time where installed, else Python's rusage of the child.
run_timed() {
  local log=$1
  shift
  if [ -x /usr/bin/time ]; then
    /usr/bin/time -v "$@" 2>"$log"
  else
    python3 - "$log" "$@" <<'PY'
import resource, subprocess, sys, time
log, cmd = sys.argv[1], sys.argv[2:]
t = time.time()
with open(log, "w") as err:
    rc = subprocess.call(cmd, stderr=err)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    err.write(f"\n\tElapsed (wall clock) time (seconds): {time.time() - t:.1f}\n")
    err.write(f"\tMaximum resident set size (kbytes): {ru.ru_maxrss}\n")
sys.exit(rc)
PY
  fi
}

for q in $QUANTS; do
  echo "== $q: convert ($(date +%T))"
  run_timed "$OUT/$q-convert.err" "$SFX_BIN/sfx-convert" --quant "$q" --head bf16 --fit "$SRC" \
    -o "$SFX_DIR/$q-fit.sfx" --json ${EXTRA:-} >"$OUT/$q-convert.json"
  grep -E "Maximum resident|Elapsed" "$OUT/$q-convert.err" || true
  echo "== $q: evaluate $EVAL ($(date +%T))"
  "$SFX_BIN/sfx-run" "$SFX_DIR/$q-fit.sfx" --ppl "$EVAL" --kl-ref "$SRC" --json \
    >"$OUT/$q-eval.json" 2>"$OUT/$q-eval.err"
  [ "$KEEP" = 1 ] || rm -f "$SFX_DIR/$q-fit.sfx"
  if [ -n "${TAR:-}" ]; then tar czf "$TAR" -C "$OUT" .; fi
done
echo "== done ($(date +%T))"
