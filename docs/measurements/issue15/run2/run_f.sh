#!/bin/bash
# Issue 15, second slice, call F (warm machine after call E: llama.cpp built, its Q4_0 GGUF
# written, our binaries in /tmp/s): the side by side again with nothing else running — call
# E's KVarN rows ran during llama.cpp's build, and a KVarN cache encodes each filled tile on
# the host CPUs, which the build occupied.
O=$OUT; t0=$(date +%s); S=/tmp/s
timeout 200 $S/sfx bench --synthetic llama-3.1-8b --quant rtn4 -p 0 -n 128 -r 3 -d 4096,32768 \
  --kv f16,2/2,3/2 > $O/sfx_bench.md 2> $O/sfx_bench.err
echo "sfx rc=$? at $(( $(date +%s) - t0 )) s"; cat $O/sfx_bench.md
for c in f16 q8_0 q4_0; do
  ( cd .peers/llamacpp && QUANTS=q4_0 ARGS="-p 0 -n 128 -r 3 -fa 1 -d 4096,32768 -ctk $c -ctv $c" DEADLINE=400 OUT=$O/peer_$c \
      timeout 240 bash device_bench.sh > /dev/null 2>&1 )
  echo "llama.cpp $c at $(( $(date +%s) - t0 )) s"; grep -E "tg128" $O/peer_$c/llamacpp_bench.md
done
