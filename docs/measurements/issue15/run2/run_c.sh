#!/bin/bash
# Issue 15, second slice, call C (fused, position-driven decode step; staged-tile attention):
# binaries and the GGUF's first part into /tmp/s for call D; KVarN op conformance; then decode
# speed on the Llama-3.1-8B shape (rtn4 weights) at three depths, FP16 KV vs KVarN 2/2 and 3/2
# held in device memory, all rows in this one call.
O=$OUT; t0=$(date +%s); S=/tmp/s; mkdir -p $S
for b in sfx sfx-run agr; do xz -dc .gpu/$b.xz > $S/$b; chmod +x $S/$b; done
cp .gpu/gguf.part00 $S/
timeout 120 $S/sfx test-backend --device cuda --op kvarn --op hadamard > $O/test_backend_kvarn.md 2>&1
echo "conformance rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "cases on|FAIL|failed \|" $O/test_backend_kvarn.md | tail -5
for d in 4096,32768 131072; do
  timeout 300 $S/sfx bench --synthetic llama-3.1-8b --quant rtn4 -p 0 -n 128 -r 3 -d $d \
    --kv f16,2/2,3/2 > $O/bench_kv_d${d%%,*}.md 2> $O/bench_kv_d${d%%,*}.err
  echo "bench -d $d rc=$? at $(( $(date +%s) - t0 )) s"; cat $O/bench_kv_d${d%%,*}.md; tail -2 $O/bench_kv_d${d%%,*}.err
done
