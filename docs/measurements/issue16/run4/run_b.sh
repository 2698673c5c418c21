#!/usr/bin/env bash
# Call B: the first half of the SmolLM2 GGUF (a call carries at most 64 MiB).
set -euo pipefail
cp .gpu2/ggufpart.00 /tmp/w/part0
ls -la /tmp/w | tee $OUT/b.txt
