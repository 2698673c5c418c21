#!/bin/bash
# Issue 15, second slice, call B (after call A left the binaries and the GGUF's first part in
# /tmp/s): SmolLM2 with the KVarN cache in device memory against the same cache on the CPU
# (cuda_agreement's kvarn cases, every base), then the austen-long:8192 KV sweep on CUDA.
O=$OUT; t0=$(date +%s); S=/tmp/s
cat $S/gguf.part00 .gpu/gguf.part01 .gpu/gguf.part02 | xz -dc > $S/model.gguf
mkdir -p $S/assets && tar xJf .gpu/texts.tar.xz -C $S/assets && mv $S/model.gguf $S/assets/SmolLM2-135M-Instruct.Q4_1.gguf
md5sum $S/assets/SmolLM2-135M-Instruct.Q4_1.gguf
SFX_REPO=$PWD SFX_ASSETS=$S/assets SFX_AGREEMENT_OUT=$O timeout 240 $S/agr kvarn > $O/agreement_kvarn.txt 2>&1
echo "agreement rc=$? at $(( $(date +%s) - t0 )) s"; tail -8 $O/agreement_kvarn.txt
SFX_ASSETS=$S/assets timeout 400 $S/sfx-run $S/assets/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \
  --ppl austen-long:8192 --kv f16,2/2,3/2,3/3,2/1 --json > $O/kv_sweep_cuda.json 2> $O/kv_sweep_cuda.err
echo "sweep rc=$? at $(( $(date +%s) - t0 )) s"; tail -12 $O/kv_sweep_cuda.err
