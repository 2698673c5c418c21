#!/usr/bin/env bash
# Call B: the first half of the SmolLM2 GGUF (the carry limit is 64 MiB a call).
set -euo pipefail
cp .gpu2/ggufpart.00 /tmp/w/part0
ls -la /tmp/w | tee $OUT/b.txt
