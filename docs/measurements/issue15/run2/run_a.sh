#!/bin/bash
# Issue 15, second slice, call A: unpack this build's binaries into /tmp/s (kept for the next
# call on the warm machine, with the first part of the SmolLM2 GGUF), the KVarN op conformance
# (split-K attention, tile-store writes and reads, Hadamard rows), then a first look at decode
# speed with the cache in device memory on the Llama-3.1-8B shape (rtn4 weights).
O=$OUT; t0=$(date +%s); S=/tmp/s; mkdir -p $S
for b in sfx sfx-run agr; do xz -dc .gpu/$b.xz > $S/$b; chmod +x $S/$b; done
cp .gpu/gguf.part00 $S/
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 120 $S/sfx test-backend --device cuda --op kvarn --op hadamard > $O/test_backend_kvarn.md 2>&1
echo "conformance rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|FAIL" $O/test_backend_kvarn.md | tail -5
timeout 300 $S/sfx bench --synthetic llama-3.1-8b --quant rtn4 -p 0 -n 128 -r 2 -d 4096,32768 \
  --kv f16,2/2,3/2 > $O/bench_quick.md 2> $O/bench_quick.err
echo "bench rc=$? at $(( $(date +%s) - t0 )) s"; cat $O/bench_quick.md; tail -3 $O/bench_quick.err
