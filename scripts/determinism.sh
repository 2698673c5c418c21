#!/usr/bin/env bash
# Determinism check (issue 20, item 4): converts one model with each of several thread counts
# and compares the SHA-256 of every file the converter wrote. Prints a table; exits 1 when any
# file differs (or a thread count wrote a different set of files), 2 on a usage error or a
# failed conversion.
#
# Needs only the sfx-convert binary, the model and the assets folder (calibration and held-out
# texts: brown/, wiki/; SFX_ASSETS), so it runs on a machine that has no checkout or toolchain.
#
# usage: scripts/determinism.sh SFX_CONVERT MODEL OUTDIR [THREADS] [QUANTS]
#   THREADS  thread counts, comma or space separated (RAYON_NUM_THREADS: sfx-convert has no
#            flag of its own; every pool it uses is rayon's global one). Default "1,2,16".
#   QUANTS   conversions separated by ';', each a --quant value followed by that conversion's
#            own options. Default "rtn3;awq3 --fit".
# environment:
#   SFX_ASSETS  the assets folder (default: the model's folder when it has brown/, else
#               ./assets)
#   EXTRA       options added to every conversion, e.g. "--calib-seqs 8 --quality none"
#   KEEP=1      keep the converted folders (default: each quant's are deleted once compared)
#   SFX_RUN     an sfx-run binary: also sample 400 tokens (temperature 0.9, seed 7, CPU) from
#               each conversion with every thread count and compare the texts
#
# example (a 16-core host, the release binary and the pinned assets copied beside the script):
#   SFX_ASSETS=$PWD/assets bash scripts/determinism.sh ./sfx-convert \
#     assets/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/det 1,2,16 "rtn3;awq3 --fit"
set -euo pipefail

usage() {
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
(($# >= 3 && $# <= 5)) || usage
convert=$1
model=$2
outdir=$3
threads=${4:-1,2,16}
quants=${5:-rtn3;awq3 --fit}

[[ -x $convert ]] || { echo "not an executable: $convert" >&2; exit 2; }
run=${SFX_RUN:-}
if [[ -n $run ]]; then
  [[ -x $run ]] || { echo "SFX_RUN: not an executable: $run" >&2; exit 2; }
  run=$(cd "$(dirname "$run")" && pwd)/$(basename "$run")
fi
[[ -e $model ]] || { echo "no such model: $model" >&2; exit 2; }
# Absolute paths: every conversion runs in its own directory, and the command line recorded in
# manifest.json must be the same text in all of them.
convert=$(cd "$(dirname "$convert")" && pwd)/$(basename "$convert")
model=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
if [[ -z ${SFX_ASSETS:-} ]]; then
  if [[ -d $(dirname "$model")/brown ]]; then SFX_ASSETS=$(dirname "$model"); else SFX_ASSETS=$PWD/assets; fi
fi
SFX_ASSETS=$(cd "$SFX_ASSETS" && pwd)
export SFX_ASSETS
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
read -r -a thread_list <<<"${threads//,/ }"
((${#thread_list[@]} >= 2)) || { echo "need at least two thread counts, got '$threads'" >&2; exit 2; }
IFS=';' read -r -a quant_list <<<"$quants"
read -r -a extra <<<"${EXTRA:-}"

echo "== $(uname -n): $(nproc) cores; $("$convert" --version 2>/dev/null || echo "$convert")"
echo "== model $model ($(sha256sum "$model" | cut -c1-16)…), assets $SFX_ASSETS"
echo "== threads ${thread_list[*]}; extra options: ${extra[*]:-none}"

status=0
summary=()
for spec in "${quant_list[@]}"; do
  read -r -a opts <<<"$spec"
  ((${#opts[@]})) || continue
  tag=$(printf '%s' "${opts[*]}" | tr -c 'A-Za-z0-9_.-' '_')
  declare -A sums=() seconds=()
  files=()
  for t in "${thread_list[@]}"; do
    dir=$outdir/$tag/t$t
    rm -rf "$dir"
    mkdir -p "$dir"
    # The same relative output path in every run: it is part of the recorded command line.
    t0=$(date +%s.%N)
    if ! (cd "$dir" && RAYON_NUM_THREADS=$t "$convert" --quant "${opts[@]}" "${extra[@]}" \
      "$model" -o out --json >report.json 2>log.txt); then
      echo "sfx-convert failed (--quant ${opts[*]}, $t threads); last lines of $dir/log.txt:" >&2
      tail -n 20 "$dir/log.txt" >&2
      exit 2
    fi
    t1=$(date +%s.%N)
    seconds[$t]=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", b - a }')
    while IFS= read -r f; do
      sums[$t/$f]=$(sha256sum "$dir/out/$f" | cut -d' ' -f1)
      [[ " ${files[*]} " == *" $f "* ]] || files+=("$f")
    done < <(cd "$dir/out" && find . -type f | sed 's|^\./||' | LC_ALL=C sort)
    echo "-- --quant ${opts[*]}: $t threads, ${seconds[$t]} s"
  done

  echo
  echo "### --quant ${opts[*]} ${extra[*]}"
  header="| file |"
  rule="|---|"
  for t in "${thread_list[@]}"; do header+=" $t threads (${seconds[$t]} s) |"; rule+="---|"; done
  echo "$header same |"
  echo "$rule---|"
  ref=${thread_list[0]}
  for f in "${files[@]}"; do
    row="| $f |"
    same=yes
    for t in "${thread_list[@]}"; do
      s=${sums[$t/$f]:-missing}
      row+=" ${s:0:16} |"
      [[ $s == "${sums[$ref/$f]:-missing}" && $s != missing ]] || same=NO
    done
    echo "$row $same |"
    if [[ $same != yes ]]; then
      status=1
      summary+=("--quant ${opts[*]}: $f differs")
    fi
  done
  if [[ -n $run ]]; then
    # One model (the first thread count's), sampled on every thread count: the decode path's
    # splits must not follow the thread count either. 400 tokens pass 256 keys, where decode
    # attention starts splitting the keys into chunks.
    model_dir=$outdir/$tag/t$ref/out
    row="| sampled text (sfx-run, 400 tokens) |"
    same=yes
    texts=()
    for t in "${thread_list[@]}"; do
      if ! "$run" "$model_dir" --device cpu -t "$t" -p "The history of the city of York" \
        -n 400 --ignore-eos --temp 0.9 --seed 7 >"$outdir/$tag/sample-t$t.txt" \
        2>"$outdir/$tag/sample-t$t.log"; then
        echo "sfx-run failed on $t threads:" >&2
        tail -n 20 "$outdir/$tag/sample-t$t.log" >&2
        exit 2
      fi
      texts+=("$(sha256sum <"$outdir/$tag/sample-t$t.txt" | cut -d' ' -f1)")
      row+=" ${texts[-1]:0:16} |"
      [[ ${texts[-1]} == "${texts[0]}" ]] || same=NO
    done
    echo "$row $same |"
    if [[ $same != yes ]]; then
      status=1
      summary+=("--quant ${opts[*]}: sampled text differs")
    fi
  fi
  echo
  [[ ${KEEP:-0} == 1 ]] || rm -rf "${outdir:?}/$tag"
  unset sums seconds
done

if ((status)); then
  printf 'MISMATCH: %s\n' "${summary[@]}"
else
  echo "all identical: ${#quant_list[@]} conversion(s) × threads ${thread_list[*]}"
fi
exit "$status"
