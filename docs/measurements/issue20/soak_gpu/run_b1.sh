#!/bin/bash
# Calls B1 (session 61): the SmolLM2 Q4_1 GGUF (98 MB) crosses to the device host in three
# carries (a call's working tree and carries must fit 64 MiB): each stashes its part in /tmp/b
# for call B2. Usage: run_b1.sh PART (p0, p1, p2; call A carries p2 beside its binaries).
mkdir -p /tmp/b && cp .gpu/gguf.$1 /tmp/b/ && ls -la /tmp/b && nproc
