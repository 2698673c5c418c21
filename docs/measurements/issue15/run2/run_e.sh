#!/bin/bash
# Issue 15, second slice, call E (warm machine, binaries in /tmp/s from call C): llama.cpp
# side by side at the same depths. Its build and GGUF writing run first in the background;
# our rows (rtn4, FP16 KV vs KVarN 2/2 and 3/2 in device memory) run during the build (our
# decode is GPU-bound with graphs; the build loads the host CPUs); then llama-bench on Q4_0 with
# f16, q8_0 and q4_0 caches (-fa 1), one cache type per run so keys and values match.
O=$OUT; t0=$(date +%s); S=/tmp/s
( cd .peers/llamacpp && QUANTS=q4_0 ARGS="-p 0 -n 1 -r 1" DEADLINE=0 OUT=$O/peer_build bash device_bench.sh > $O/peer_build.txt 2>&1 ) &
timeout 200 $S/sfx bench --synthetic llama-3.1-8b --quant rtn4 -p 0 -n 128 -r 3 -d 4096,32768 \
  --kv f16,2/2,3/2 > $O/sfx_bench.md 2> $O/sfx_bench.err
echo "sfx rc=$? at $(( $(date +%s) - t0 )) s"; cat $O/sfx_bench.md
wait; echo "llama.cpp ready at $(( $(date +%s) - t0 )) s"; tail -3 $O/peer_build.txt
for c in f16 q8_0 q4_0; do
  ( cd .peers/llamacpp && QUANTS=q4_0 ARGS="-p 0 -n 128 -r 3 -fa 1 -d 4096,32768 -ctk $c -ctv $c" DEADLINE=400 OUT=$O/peer_$c \
      timeout 240 bash device_bench.sh > /dev/null 2>&1 )
  echo "llama.cpp $c at $(( $(date +%s) - t0 )) s"; grep -E "tg128" $O/peer_$c/llamacpp_bench.md
done
