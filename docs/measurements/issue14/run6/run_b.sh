#!/bin/bash
# Issue 14 sixth slice, call B: the wide-preset refined decode cases' failure on CUDA (found by
# reading: launches of different shapes shared one gather scratch whose ticket region moved
# with the launch's slab count), then issue 13's side-by-side with llama.cpp (its build runs
# while the conformance does).
# sfx   = 9955a3f + the fix (tickets in a fixed region) + the conformance case that shares a
#         scratch between shapes + model_diag2.patch (a throwaway op `model_diag`, and every
#         case's family followed by each logits row's own error: prompt rows, then steps);
# nofix = the same without the fix (the new case must fail on it).
O=$OUT; t0=$(date +%s); mkdir -p /tmp/b $O/b
el() { echo $(( $(date +%s) - t0 )); }
for n in diag nofix; do xz -dc .gpu/$n.xz > /tmp/b/$n; chmod +x /tmp/b/$n; done; S=/tmp/b/diag
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
(QUANTS="q2_k q4_k_m q4_0" DEADLINE=0 OUT=$O/b/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1) &
peer=$!
run_tb() { # name, env..., args
  local n=$1; shift
  env "$@" > $O/b/$n.md 2>&1; local rc=$?
  echo "[$(el)s] $n rc=$rc: $(grep 'cases on cuda' $O/b/$n.md)"
  grep -E '^\| [a-z_]+ \|' $O/b/$n.md | grep -v -e '| ok |' -e '^| op |' | cut -d'|' -f2,3,5,6,7 | cut -c1-400
}
run_tb nofix_columns timeout 60 /tmp/b/nofix test-backend --device cuda --op add_selected_columns --op lead_columns --seed 1
run_tb nofix_decode timeout 60 /tmp/b/nofix test-backend --device cuda --op model_decode --seed 1
run_tb refine_ops timeout 120 $S test-backend --device cuda --op select_channels --op add_selected_columns --op lead_columns --op refined --op lead --seed 1
run_tb diag timeout 200 $S test-backend --device cuda --op model_diag --seed 1
run_tb decode_s1_a timeout 60 $S test-backend --device cuda --op model_decode --seed 1
run_tb decode_s1_b timeout 60 $S test-backend --device cuda --op model_decode --seed 1
run_tb decode_s1_nobranch SFX_BRANCHES=0 timeout 60 $S test-backend --device cuda --op model_decode --seed 1
echo "[$(el)s] waiting for llama.cpp's build"
wait $peer
QUANTS="q2_k q4_k_m q4_0" ARGS="-p 512 -n 128 -r 3 -fa 1" DEADLINE=600 OUT=$O/b/peer bash .peers/llamacpp/device_bench.sh > /dev/null 2>&1
echo "[$(el)s] llama.cpp:"; grep -E '^\|' $O/b/peer/llamacpp_bench.md
for f in rtn2 rtn3 rtn4 qtip2:hyb qtip2:1mad qtip3:hyb qtip4:hyb; do
  [ $(el) -gt 540 ] && { echo "skip $f: past 540 s"; continue; }
  code=(); [ "${f#*:}" != "$f" ] && code=(--trellis-code "${f##*:}")
  timeout 60 $S bench --synthetic llama-3.1-8b --device cuda --quant "${f%%:*}" "${code[@]}" -p 512 -n 128 -r 3 > $O/b/bench_${f/:/_}.md 2>&1
  echo "[$(el)s] $f: $(grep -E '^\| llama' $O/b/bench_${f/:/_}.md | awk -F'|' '{print $9 $10 $11}' | tr '\n' ' ')"
done
rm -f $O/b/peer/*.gguf
tar czf $O/b.tgz -C $O b && rm -rf $O/b
echo "total $(el) s"
