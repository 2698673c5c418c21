#!/bin/bash
# Issue 15, fourth slice, call G, right after call F on the warm machine (binaries and the GGUF
# parts in /tmp). llama.cpp (0c1e570) builds on the host CPUs and its Q4_0 GGUF is written while
# the GPU runs the SmolLM2 CUDA-vs-CPU agreement of the device KVarN cache and the
# austen-long:8192 sweep on CUDA (KL and PPL only: the build shares the CPUs). Then, with
# nothing else running, the Llama-3.1-8B-shape side by side: our rtn4 with FP16 KV, 2/2, 3/2
# and 2/2 +4/+4 refined (ram, vram), and llama.cpp Q4_0 with f16, q8_0 and q4_0 caches, each
# at 4K and 32K.
set -u
t0=$(date +%s); S=/tmp/s; B=/tmp/x
cat $S/gguf.part.aa $S/gguf.part.ab $S/gguf.part.ac | xz -dc > $S/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum $S/SmolLM2-135M-Instruct.Q4_1.gguf
tar -xJf $S/texts.tar.xz -C $S; mv $S/assets/* $S/ 2>/dev/null
( cd .peers/llamacpp && QUANTS=" " OUT=/tmp/peer_build bash device_bench.sh > /dev/null 2>&1 ) &
BUILD=$!
mkdir -p /tmp/llamacpp-peer; python3 .peers/llamacpp/mkgguf.py /tmp/llamacpp-peer/llama8b-q4_0.gguf --ftype q4_0 > /dev/null 2>&1 &
GGUF=$!
mkdir -p /tmp/agree; SFX_ASSETS=$S SFX_AGREEMENT_OUT=/tmp/agree SFX_REPO=$PWD timeout 200 $B/cuda_agreement kvarn > $OUT/agreement_kvarn.txt 2>&1
echo "agreement rc=$? at $(( $(date +%s) - t0 )) s"; grep -E "^test |KL|result" $OUT/agreement_kvarn.txt | tail -12
tar -cf $OUT/agreement_json.tar -C /tmp/agree .
SFX_ASSETS=$S timeout 200 $B/sfx-run $S/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \
  --ppl austen-long:8192 --kv f16,2/2,3/2,3/3,2/1 --kv-refine auto --kv-group 2 --kv-fraction 1/128 \
  --json > $OUT/kv_sweep_cuda.json 2> $OUT/kv_sweep_cuda.err; echo "sweep rc=$? at $(( $(date +%s) - t0 )) s"
wait $BUILD $GGUF; echo "llama.cpp built, GGUF written at $(( $(date +%s) - t0 )) s"; tail -2 /tmp/peer_build/llamacpp_log.txt
timeout 200 $B/sfx bench --synthetic llama-3.1-8b --device cuda --quant rtn4 -p 0 -n 128 -r 2 -d 4096,32768 \
  --kv f16,2/2,3/2,2/2+4/4,2/2+4/4@vram > $OUT/sfx_bench.md 2> $OUT/sfx_bench.err
echo "sfx rc=$? at $(( $(date +%s) - t0 )) s"; cat $OUT/sfx_bench.md
for c in f16 q8_0 q4_0; do
  ( cd .peers/llamacpp && QUANTS=q4_0 ARGS="-p 0 -n 128 -r 2 -fa 1 -d 4096,32768 -ctk $c -ctv $c" DEADLINE=400 OUT=$OUT/peer \
      timeout 100 bash device_bench.sh > /dev/null 2>&1 )
  echo "llama.cpp $c at $(( $(date +%s) - t0 )) s"
done
grep -E "tg128" $OUT/peer/llamacpp_bench.md
